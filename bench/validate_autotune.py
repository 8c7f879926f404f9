"""Prediction against measurement for the autotuner, on CPU tensors: predicted stall per window vs measured.

The "model" is a set of offloaded matrices whose gradients are fixed tensors assigned before every step, and
whose forward and backward are a ``time.sleep(step_time)``: the step time is known and nothing but the
optimizer competes with the host worker. For each setting, ``"auto"`` and deliberately bad fixed ones, it
runs whole selection cycles after the warm-up and compares the wait per window that ``stats()`` measured
(``measured_stall_per_window_s``: time ``step()`` waited on host work) with the plan's ``predicted_wait_s``;
the plan's ``predicted_stall_s`` adds the copies that nothing hides, which ``stats()`` counts in ``device_opt_s``
(the "dev" columns). Pass: within 30% or 5 ms.

    python bench/validate_autotune.py                      # quick probe first, then every setting
    python bench/validate_autotune.py --profile PATH       # a profile from `python -m zenflow_triton.autotune`
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from dataclasses import dataclass

import torch

from zenflow_triton import ZenFlowAdamW
from zenflow_triton.autotune import ENV_VAR, Plan, ProbeSettings, load_profile, plan_for_optimizer, probe_machine
from zenflow_triton.autotune.cache import save_profile

__all__ = ["main"]


@dataclass
class Outcome:
    label: str
    topk_ratio: float
    update_interval: int
    cpu_threads: int
    step_time_s: float
    predicted_wait_s: float
    measured_wait_s: float
    predicted_job_s: float
    measured_job_s: float
    predicted_device_s: float
    measured_device_s: float
    windows: int

    @property
    def ok(self) -> bool:
        err = abs(self.measured_wait_s - self.predicted_wait_s)
        return err <= 0.005 or err <= 0.3 * max(self.measured_wait_s, 1e-12)


def _snapshot(opt: ZenFlowAdamW) -> dict[str, float]:
    s = opt.stats()
    return {"stall_s": s["stall_s"], "windows": s["windows"], "host_job_s": s["host_job_s"],
            "device_opt_s": s["device_opt_s"], "steps": s["steps"]}


def run_setting(label: str, shapes: list[tuple[int, int]], step_time: float, cycles: int, **opt_kwargs) -> Outcome:
    gen = torch.Generator().manual_seed(0)
    params = [torch.nn.Parameter(torch.randn(r, c, generator=gen) * 0.02) for r, c in shapes]
    grads = [torch.randn(r, c, generator=gen) * 1e-3 for r, c in shapes]
    warmup = 5
    opt = ZenFlowAdamW(params, lr=1e-4, warmup_steps=warmup, **opt_kwargs)
    outside: list[float] = []
    last_end: list[float] = []

    def one_step() -> None:
        for p, g in zip(params, grads):
            p.grad = g
        time.sleep(step_time)  # the model's forward and backward
        if last_end:
            outside.append(time.perf_counter() - last_end[-1])
        opt.step()
        last_end.append(time.perf_counter())

    try:
        for _ in range(warmup + 1):  # the first step after the warm-up fixes the "auto" settings
            one_step()
        select = opt.stats()["select_interval"]
        # Skip the first selection cycle (the pipeline fills), then measure whole cycles from right before a
        # selection step, so each measured cycle holds exactly one flush.
        for _ in range(select - 1):
            one_step()
        start_stats = _snapshot(opt)
        for _ in range(cycles * select):
            one_step()
        end_stats = _snapshot(opt)
        s = opt.stats()
        windows = end_stats["windows"] - start_stats["windows"]
        # r = 1 has no host windows at all (DESIGN §3): nothing waited, nothing to divide.
        measured_wait = (end_stats["stall_s"] - start_stats["stall_s"]) / windows if windows else 0.0
        measured_job = (end_stats["host_job_s"] - start_stats["host_job_s"]) / windows if windows else 0.0
        # step() time that was not stall: the device-side step plus, at window ends, the copies and the merge.
        measured_device = (end_stats["device_opt_s"] - start_stats["device_opt_s"]) / (
            end_stats["steps"] - start_stats["steps"])
        t_meas = statistics.median(outside[warmup:])
        plan: Plan | None = opt._knobs.plan  # the autotuner's plan for "auto"; None for fixed settings
        if plan is None:
            plan = plan_for_optimizer(
                offloaded_shapes=shapes, param_dtype=torch.float32, grad_dtype="float32", step_time_s=t_meas,
                device=torch.device("cpu"), topk_ratio=s["topk_ratio"], update_interval=s["update_interval"],
                cpu_threads=s["cpu_threads"], overlap=opt.config.overlap,
            )
        return Outcome(label=label, topk_ratio=s["topk_ratio"], update_interval=s["update_interval"],
                       cpu_threads=s["cpu_threads"], step_time_s=t_meas, predicted_wait_s=plan.predicted_wait_s,
                       measured_wait_s=measured_wait, predicted_job_s=plan.prediction.job_s,
                       measured_job_s=measured_job, predicted_device_s=plan.prediction.device_step_s
                       + plan.prediction.copy_s / plan.update_interval, measured_device_s=measured_device,
                       windows=int(windows))
    finally:
        opt.close()


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--profile", help="profile file (default: a quick probe now, saved to a temporary file)")
    parser.add_argument("--step-time", type=float, default=0.02, help="seconds of sleep per step (default 0.02)")
    parser.add_argument("--rows", type=int, default=1024)
    parser.add_argument("--cols", type=int, default=2048)
    parser.add_argument("--matrices", type=int, default=4)
    parser.add_argument("--cycles", type=int, default=3, help="selection cycles measured per setting")
    parser.add_argument("--torch-threads", type=int, default=1,
                        help="torch threads of the training thread (default 1: the worker takes another core)")
    args = parser.parse_args(argv)
    torch.set_num_threads(args.torch_threads)
    shapes = [(args.rows, args.cols)] * args.matrices
    if args.profile:
        os.environ[ENV_VAR] = args.profile
        load_profile(args.profile)
    else:
        started = time.perf_counter()
        prof = probe_machine(ProbeSettings.quick_settings())
        print(f"quick probe: {time.perf_counter() - started:.1f} s", file=sys.stderr)
        path = os.path.join(tempfile.mkdtemp(prefix="zf-validate-"), "profile.json")
        save_profile(prof, path)
        os.environ[ENV_VAR] = path
    print(f"load average {os.getloadavg()[0]:.2f} on {os.cpu_count()} cores; "
          f"{len(shapes)} x {shapes[0]} fp32 params, sleep {args.step_time * 1e3:.0f} ms per step", file=sys.stderr)

    results = [run_setting("auto", shapes, args.step_time, args.cycles, topk_ratio="auto", update_interval="auto")]
    auto = results[0]
    # "auto" may keep every column on the device (r = 1: no host work to predict); the fixed settings have some.
    r = auto.topk_ratio if auto.topk_ratio < 1 else 0.1
    results.append(run_setting("0.1 / 4", shapes, args.step_time, args.cycles, topk_ratio=0.1, update_interval=4))
    # Deliberately bad: the shortest window, overlapped and not (the host job then waits every window).
    results.append(run_setting("U=1", shapes, args.step_time, args.cycles, topk_ratio=r, update_interval=1))
    results.append(run_setting("U=1 sync", shapes, args.step_time, args.cycles, topk_ratio=r, update_interval=1,
                               overlap=False))
    header = (f"{'setting':<10} {'r':>8} {'U':>3} {'thr':>3} {'step':>8} {'windows':>7} {'dev pred':>9} "
              f"{'dev meas':>9} {'job pred':>9} {'job meas':>9} {'wait pred':>10} {'wait meas':>10}  verdict")
    print(header)
    for o in results:
        print(f"{o.label:<10} {o.topk_ratio:>8.3g} {o.update_interval:>3} {o.cpu_threads:>3} "
              f"{o.step_time_s * 1e3:>6.1f}ms {o.windows:>7} {o.predicted_device_s * 1e3:>7.1f}ms "
              f"{o.measured_device_s * 1e3:>7.1f}ms {o.predicted_job_s * 1e3:>7.1f}ms "
              f"{o.measured_job_s * 1e3:>7.1f}ms {o.predicted_wait_s * 1e3:>8.1f}ms {o.measured_wait_s * 1e3:>8.1f}ms"
              f"  {'ok' if o.ok else 'MISS'}")
    print("dev = step() time other than stall, per step (device-side step, plus copies and merge at window ends); "
          "job = host job per window; wait = time step() waited on host work, per window (selection flushes "
          "included); pass = wait within 30% or 5 ms")
    return 0 if all(o.ok for o in results) else 1


if __name__ == "__main__":
    sys.exit(main())
