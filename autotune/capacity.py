"""What is the biggest model I can train here? Device and host bytes per parameter of each mode, from the optimizer's
layout formulas (:func:`.model.device_bytes_per_param`, :func:`.placement.host_views`), against a machine's memories.

    python -m zenflow_triton.autotune --params 7B         # each mode's bytes and whether it fits this machine
    python -m zenflow_triton.autotune --max-params        # the largest model per mode on this machine
    python -m zenflow_triton.autotune.capacity            # the largest model per mode on three common machines

A model fits when ``device B/param × params ≤ GPU_USABLE × GPU memory`` (the rest: activations, the CUDA context)
and ``host B/param × params`` fits the host: ``HOST_USABLE`` of its memory on the table's machines, what the
optimizer's pre-flight would find available on this one (:func:`zenflow_triton.host_budget.host_room`). Device
bytes held per parameter: the weight, its gradient (none with ``grads_in_backward``: the hooks take it during
backward) and the optimizer's device state. ``bench/plot_docs.py memory`` measures the same figures on a model
and computes its largest-model table with :func:`largest`.
"""

from __future__ import annotations

import dataclasses
import math
import sys
from collections.abc import Sequence
from dataclasses import dataclass
from types import SimpleNamespace

from .model import device_bytes_per_param
from .placement import host_bytes_per_element

__all__ = ["GPU_USABLE", "HOST_USABLE", "MACHINES", "PEERS_HOST", "Mode", "fit_report", "largest", "machines_table",
           "max_report", "modes"]

# Share of each memory a model's training state may take: the rest of the GPU holds activations and the CUDA
# context, the rest of the host the OS and the data pipeline.
GPU_USABLE, HOST_USABLE = 0.8, 0.9

# Machines of the largest-model tables: (name, GPU bytes, host bytes).
MACHINES = [("24 GB GPU / 64 GB host", 24e9, 64e9), ("80 GB / 256 GB", 80e9, 256e9),
            ("141 GB / 128 GiB (one H200)", 141e9, 128 * 2**30)]

# Host bytes per parameter that the peers hold for a bf16 model with an fp32 master and Adam, read from their
# allocating code (issue 29): FSDP2 CPUOffloadPolicy 16 (fp32 param, grad, m, v), ZeRO-Offload stage 2 18 (fp32
# master 4, bf16 copy-back 2, fp32 gradient 4, m + v 8), DeepSpeed's ZenFlow with overlap ~36 (two gradient buffers
# and two full moment sets), torchao CPUOffloadOptimizer 8 (bf16 master and moments: no fp32 master for bf16).
PEERS_HOST = {"ZeRO-Offload stage 2": 18.0, "FSDP2 `CPUOffloadPolicy`": 16.0, "DeepSpeed ZenFlow, overlap": 36.0,
              "torchao `CPUOffloadOptimizer`, no fp32 master": 8.0}


@dataclass(frozen=True)
class Mode:
    """One configuration's bytes per offloaded parameter: ``device`` held on the GPU, ``host`` in the slab."""

    label: str
    device: float
    host: float


def _has_state_dtype() -> bool:
    from zenflow_triton.config import ZenFlowConfig

    return "state_dtype" in {f.name for f in dataclasses.fields(ZenFlowConfig)}


def modes(*, param_bytes: int = 2, grad_dtype: str = "float32", topk_ratio: float = 0.1) -> list[Mode]:
    """Each accumulate mode (and ``grads_in_backward``; with bf16 moments where the optimizer has them, and with
    ``overlap_steps=1`` where the layout holds less with it, then also without the host snapshot where there is one),
    at ``topk_ratio``, for a model of ``param_bytes`` per element."""
    out = []
    moments = ["float32"] + (["bfloat16"] if _has_state_dtype() else [])
    for state in moments:
        for label, mode, grads in (('accumulate="device"', "device", param_bytes),
                                   ('accumulate="host"', "host", param_bytes),
                                   ('"host" + grads_in_backward', "host", 0)):
            device = param_bytes + grads + device_bytes_per_param(topk_ratio, mode)
            default, one_sum, lean = (
                float(host_bytes_per_element(SimpleNamespace(grad_dtype=grad_dtype, state_dtype=state,
                                                             overlap_steps=steps, grads_in_backward=grads == 0,
                                                             host_snapshot=snapshot), mode, param_bytes))
                for steps, snapshot in ((None, True), (1, True), (1, False)))
            steps = ", overlap_steps=1" if one_sum < default else ""  # named only where it cuts (one window sum)
            moments = ', state_dtype="bfloat16"' if state == "bfloat16" else ""
            out.append(Mode(label + moments, device, default))
            if steps:
                out.append(Mode(label + moments + steps, device, one_sum))
            if lean < one_sum:
                out.append(Mode(label + moments + steps + ", host_snapshot=False", device, lean))
    return out


def largest(device_bpp: float, host_bpp: float, gpu_bytes: float | None, host_bytes: float, *,
            gpu_usable: float = GPU_USABLE, host_usable: float = HOST_USABLE) -> tuple[float, str]:
    """Parameters whose training state fits both memories, and the bound that binds ("GPU" or "host"):
    ``min(gpu_usable × gpu_bytes / device_bpp, host_usable × host_bytes / host_bpp)``. ``gpu_bytes`` None or a
    zero ``device_bpp``: the GPU does not bound it (CPU tensors; a peer counted by its host bytes only)."""
    by_gpu = gpu_usable * gpu_bytes / device_bpp if gpu_bytes and device_bpp else math.inf
    by_host = host_usable * host_bytes / host_bpp if host_bpp else math.inf
    return (by_host, "host") if by_host < by_gpu else (by_gpu, "GPU")


def machines_table(rows: Sequence[Mode] | None = None) -> str:
    """The largest bf16 model per machine of :data:`MACHINES`, billions of parameters: ours per mode (``rows``,
    default :func:`modes`) beside the peers' host bytes."""
    rows = modes() if rows is None else rows
    lines = ["| optimizer | " + " | ".join(m[0] for m in MACHINES) + " |", "|---|" + "---:|" * len(MACHINES)]
    cells = [(f"ZenFlowAdamW {r.label} ({r.device:.2f} device, {r.host:g} host B/param)", r.device, r.host)
             for r in rows]
    cells += [(f"{name} ({b:g} host B/param)", 0.0, b) for name, b in PEERS_HOST.items()]
    for name, dev, host in cells:
        fits = [largest(dev, host, gpu, hb) for _, gpu, hb in MACHINES]
        lines.append(f"| {name} | " + " | ".join(f"{n / 1e9:.1f} ({why})" for n, why in fits) + " |")
    return "\n".join(lines)


# ----------------------------------------------------------------------------------------------- this machine


def this_machine() -> tuple[float | None, str, float | None, str]:
    """(GPU bytes or None, its name, host bytes available now or None, the bound that set them)."""
    import torch

    from zenflow_triton.host_budget import host_room

    gpu, name = None, "no CUDA device: device and host memory are one"
    if torch.cuda.is_available():
        props = torch.cuda.get_device_properties(0)
        gpu, name = float(props.total_memory), props.name
    room = host_room(pinned=gpu is not None)
    return gpu, name, (None if room.bytes is None else float(room.bytes)), room.bound


def _gib(n: float) -> str:
    return f"{n / 2**30:.1f} GiB"


def _machine_line(gpu: float | None, name: str, host: float | None, bound: str) -> str:
    device = f"GPU {name}, {_gib(gpu)} ({GPU_USABLE:.0%} usable)" if gpu else name
    return f"this machine: {device}; host {_gib(host) if host else 'unknown'} available now ({bound})"


def _check(rows: Sequence[Mode], gpu: float | None, host: float | None) -> list[tuple[Mode, float, str]]:
    # On CPU tensors the "device" state is host memory too: both count against the host.
    return [(r, *largest(r.device if gpu else 0.0, r.host + (0.0 if gpu else r.device), gpu, host or math.inf,
                         host_usable=1.0)) for r in rows]


def _report(what: str, param_bytes: int, grad_dtype: str, topk_ratio: float,
            machine: tuple[float | None, str, float | None, str] | None) -> tuple[list[str], list, int]:
    """The first lines of a report on each mode for this machine, the rows checked and the mode column's width."""
    gpu, name, host, bound = this_machine() if machine is None else machine
    checked = _check(modes(param_bytes=param_bytes, grad_dtype=grad_dtype, topk_ratio=topk_ratio), gpu, host)
    width = max([46] + [len(r.label) for r, _, _ in checked])
    return [f"{what} ({param_bytes} B per parameter, grad_dtype {grad_dtype}, topk_ratio {topk_ratio:g}); "
            f"{_machine_line(gpu, name, host, bound)}", ""], checked, width


def fit_report(params: float, *, param_bytes: int = 2, grad_dtype: str = "float32", topk_ratio: float = 0.1,
               machine: tuple[float | None, str, float | None, str] | None = None) -> str:
    """Per mode, the device and host bytes of a ``params``-parameter model and whether it fits this machine."""
    lines, checked, w = _report(f"{params / 1e9:g}B parameters", param_bytes, grad_dtype, topk_ratio, machine)
    lines.append(f"  {'mode':<{w}} {'device B/param':>14} {'device GiB':>10} {'host B/param':>12} {'host GiB':>9}"
                 "  fits")
    for r, most, why in checked:
        verdict = "yes" if params <= most else f"no ({why} memory)"
        lines.append(f"  {r.label:<{w}} {r.device:>14.2f} {params * r.device / 2**30:>10.1f} {r.host:>12g} "
                     f"{params * r.host / 2**30:>9.1f}  {verdict}")
    return "\n".join(lines)


def max_report(*, param_bytes: int = 2, grad_dtype: str = "float32", topk_ratio: float = 0.1,
               machine: tuple[float | None, str, float | None, str] | None = None) -> str:
    """Per mode, the largest model whose training state fits this machine, and the memory that bounds it."""
    lines, checked, w = _report("largest model per mode", param_bytes, grad_dtype, topk_ratio, machine)
    lines.append(f"  {'mode':<{w}} {'device B/param':>14} {'host B/param':>12} {'largest':>10}  bound")
    for r, most, why in checked:
        lines.append(f"  {r.label:<{w}} {r.device:>14.2f} {r.host:>12g} {most / 1e9:>9.2f}B  {why}")
    return "\n".join(lines)


def main(argv: Sequence[str] | None = None) -> int:
    """``python -m zenflow_triton.autotune.capacity``: the machines table."""
    del argv
    print(f"Largest bf16 model whose training state fits, billions of parameters ({GPU_USABLE:.0%} of the GPU and "
          f"{HOST_USABLE:.0%} of the host usable; ours from the layout formulas at topk_ratio 0.1, the peers from "
          "their host bytes only; the bound that binds in brackets):")
    print()
    print(machines_table())
    return 0


if __name__ == "__main__":
    sys.exit(main())
