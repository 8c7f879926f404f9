"""``python -m zenflow_triton.autotune``: measure this machine, save its profile, show what would be chosen.

Progress goes to stderr; the table (or ``--json``) to stdout. Exit codes, for scripts:

- 0: success
- 2: bad command line (argparse)
- 3: a measurement failed
- 4: no usable profile (``--load`` found none or an invalid one; planning for a GPU the profile lacks)
- 5: could not write the profile or the plot
- 6: an optional dependency is missing (``--plot`` needs matplotlib: ``pip install -e '.[plot]'`` from the checkout)
- 7: the quality table (``--quality-table``) cannot be read or is malformed

The choice weighs the predicted step time against the predicted loss ratio vs AdamW (``--max-loss-ratio``) from a
quality table: the shipped one (:mod:`.quality`) or yours (``--quality-table``).

The output says what was measured (sizes, repeats, each figure's spread), warns when the machine was busy, where
the profile went and whether ``"auto"`` will read it from there, and, for one model (``--params``), the constructor
call with the chosen knobs. A saved profile measured calmer than this run (lower median spread) is kept unless
``--force``.
"""

from __future__ import annotations

import argparse
import json
import math
import os
import sys
import time
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from zenflow_triton.config import DEFAULT_SELECT_WINDOWS

from .bridge import MEMORY_BUDGET_FRACTION, QUALITY_ENV_VAR, quality_table_for
from .cache import ENV_VAR, ProfileError, default_profile_path, load_profile, save_profile
from .chooser import plan_accumulate
from .model import (
    ACCUMULATE_MODES,
    DEFAULT_MAX_LOSS_RATIO,
    GRAD_BYTES,
    Plan,
    Targets,
    Workload,
    shapes_for_param_count,
)
from .profile import Profile
from .quality import QualityTable, QualityTableError
from .render import memory_rows, plot, render

__all__ = ["main", "build_parser", "EXIT_OK", "EXIT_PROBE_FAILED", "EXIT_NO_PROFILE", "EXIT_WRITE_FAILED",
           "EXIT_MISSING_DEPENDENCY", "EXIT_BAD_QUALITY_TABLE"]

EXIT_OK = 0
EXIT_PROBE_FAILED = 3
EXIT_NO_PROFILE = 4
EXIT_WRITE_FAILED = 5
EXIT_MISSING_DEPENDENCY = 6
EXIT_BAD_QUALITY_TABLE = 7

_PARAM_BYTES = {"float32": 4, "bfloat16": 2, "float16": 2}
# Example models for the "would choose" table when --params is not given: sizes one fine-tunes on such a machine.
_EXAMPLES = {
    "cuda": [(1.3e9, 0.25), (1.3e9, 1.0), (7e9, 0.25), (7e9, 1.0), (13e9, 1.0)],
    "cpu": [(10e6, 0.05), (10e6, 0.5), (100e6, 0.5), (100e6, 2.0), (1e9, 5.0)],
}


def _count(text: str) -> int:
    """A positive count; accepts 7e9, 7_000_000_000, 125M, 7B."""
    t = text.strip().replace("_", "")
    scale = {"k": 1e3, "m": 1e6, "g": 1e9, "b": 1e9, "t": 1e12}.get(t[-1:].lower(), 1)
    try:
        value = float(t[:-1] if scale != 1 else t) * scale
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a count: {text!r}") from None
    if not (math.isfinite(value) and value >= 1):
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return int(value)


def _positive(text: str) -> float:
    try:
        value = float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not a number: {text!r}") from None
    if not (math.isfinite(value) and value > 0):
        raise argparse.ArgumentTypeError(f"must be > 0: {text!r}")
    return value


def _fraction(text: str) -> float:
    value = _positive(text)
    if value >= 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1): {text!r}")
    return value


def _ratio_bound(text: str) -> float:
    value = _positive(text)
    if value > 1:
        raise argparse.ArgumentTypeError(f"must be in (0, 1]: {text!r}")
    return value


def _loss_budget(text: str) -> float:
    value = _positive(text)
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1 (1 is AdamW's loss): {text!r}")
    return value


def _interval(text: str) -> int:
    try:
        value = int(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"not an integer: {text!r}") from None
    if value < 1:
        raise argparse.ArgumentTypeError(f"must be >= 1: {text!r}")
    return value


def build_parser() -> argparse.ArgumentParser:
    parser = argparse.ArgumentParser(
        prog="python -m zenflow_triton.autotune",
        description="Measure this machine's PCIe, host AdamW and device figures for zenflow_triton, save the "
                    "profile, and show the topk_ratio / update_interval it would choose.",
        epilog=f"The profile goes to ${ENV_VAR} if set, else the per-user cache folder. Exit codes: 0 ok, "
               "2 usage, 3 measurement failed, 4 no usable profile, 5 write failed, 6 missing optional "
               "dependency (matplotlib for --plot), 7 unreadable quality table.",
    )
    parser.add_argument("--quick", action="store_true", help="a few seconds of measuring instead of a full run")
    out = parser.add_mutually_exclusive_group()
    out.add_argument("--output", "-o", metavar="PATH", type=Path,
                     help=f"write the profile here (default: ${ENV_VAR}, else the per-user cache)")
    out.add_argument("--no-save", action="store_true", help="do not write the profile")
    parser.add_argument("--force", action="store_true",
                        help="replace the saved profile even when it was measured calmer (lower spread) than this run")
    parser.add_argument("--load", nargs="?", const="", metavar="PATH",
                        help="plan from a saved profile instead of measuring (default: the usual location)")
    plan_group = parser.add_argument_group("planning for a model")
    plan_group.add_argument("--params", type=_count, metavar="N",
                            help="offloaded parameter count (7e9, 7B, 125M): with --step-time, the plan; alone, "
                                 "each mode's device and host bytes and whether they fit this machine (no measuring)")
    plan_group.add_argument("--step-time", type=_positive, metavar="S",
                            help="seconds per training step outside the optimizer; needs --params")
    plan_group.add_argument("--param-dtype", choices=sorted(_PARAM_BYTES), default="bfloat16")
    plan_group.add_argument("--grad-dtype", choices=sorted(GRAD_BYTES), default="float32")
    plan_group.add_argument("--device", choices=("auto", "cuda", "cpu"), default="auto",
                            help="plan for CUDA or CPU tensors (auto: CUDA when the profile has a GPU)")
    plan_group.add_argument("--memory-budget", type=_positive, metavar="GIB",
                            help="device memory (GiB) the optimizer's device state may use (default: "
                                 f"{MEMORY_BUDGET_FRACTION * 100:.0f}%% of free memory less the model's weights "
                                 "and grads)")
    plan_group.add_argument("--accumulate", choices=("auto", *ACCUMULATE_MODES), default="auto",
                            help="where the window sum lives (ZenFlowAdamW's accumulate): auto (default) places it "
                                 "as the optimizer does, on the device when its state fits the memory budget, else "
                                 "on the host; always the device for CPU tensors")
    plan_group.add_argument("--max-loss-ratio", type=_loss_budget, default=DEFAULT_MAX_LOSS_RATIO, metavar="X",
                            help="quality budget: largest predicted held-out loss over AdamW's at equal steps "
                                 "(default %(default)s); raise it to trade quality for speed")
    plan_group.add_argument("--max-update-interval", type=_interval, default=Targets().max_update_interval,
                            metavar="U", help="never choose a longer window (default %(default)s; the quality "
                                              "table's range limits it further)")
    plan_group.add_argument("--min-topk-ratio", type=_ratio_bound, default=None, metavar="R",
                            help="never choose a smaller ratio (default: the quality table's smallest)")
    plan_group.add_argument("--quality-table", metavar="PATH",
                            help=f"loss ratios vs AdamW measured on your task (JSON; format: "
                                 f"zenflow_triton.autotune.quality; default ${QUALITY_ENV_VAR}, else the shipped "
                                 "table of the demo's fine-tune)")
    plan_group.add_argument("--quality-regime", choices=["worst", "finetune", "scratch"], default="worst",
                            help="which of the table's regimes predicts the loss (default: the worse of the fine-tune "
                                 "and from scratch at each point; a table without regimes answers for all)")
    plan_group.add_argument("--target-stall", type=_fraction, default=Targets().stall_fraction, metavar="F",
                            help="stall, as a fraction of the step time, up to which host work counts as hidden "
                                 "(default %(default)s)")
    parser.add_argument("--plot", type=Path, metavar="PATH",
                        help="PNG of the predicted step time over (update_interval, topk_ratio), with the region "
                             "within the loss budget and the choice marked (matplotlib)")
    parser.add_argument("--json", action="store_true", help="print JSON (profile and plans) instead of the table")
    parser.add_argument("--show-profile", action="store_true",
                        help="with --load, print the profile's measured figures too (a measuring run always does)")
    parser.add_argument("--quiet", "-q", action="store_true", help="no progress on stderr")
    _add_capacity_flags(plan_group)
    adv = parser.add_argument_group("advanced (smaller measurements)")
    adv.add_argument("--adamw-numel", type=_count, metavar="N", help="elements per timed host AdamW call")
    adv.add_argument("--max-copy-bytes", type=_count, metavar="N", help="largest copy size measured")
    return parser


def _add_capacity_flags(group: argparse._ArgumentGroup) -> None:
    group.add_argument("--max-params", action="store_true",
                       help="print the largest model per mode whose training state fits this machine's GPU and "
                            "host memory (no measuring; --param-dtype, --grad-dtype apply)")


def _capacity(args: argparse.Namespace) -> int:
    """``--params N`` alone or ``--max-params``: the capacity answer (:mod:`.capacity`), from the layout formulas
    and this machine's memories, without measuring anything."""
    from .capacity import fit_report, max_report

    knobs = {"param_bytes": _PARAM_BYTES[args.param_dtype], "grad_dtype": args.grad_dtype}
    print(max_report(**knobs) if args.max_params else fit_report(float(args.params), **knobs))
    return EXIT_OK


def probe_machine(*args: Any, **kwargs: Any) -> Profile:
    """:func:`.probes.probe_machine`, imported here on first use: it imports torch, which ``--help`` never needs."""
    from .probes import probe_machine as measure

    return measure(*args, **kwargs)


def _err(msg: str) -> None:
    print(f"zenflow_triton.autotune: {msg}", file=sys.stderr)


# ----------------------------------------------------------------------------------------------- plans


def _workload(profile: Profile, args: argparse.Namespace, params: float, step_time: float) -> Workload:
    kind = args.device if args.device != "auto" else ("cuda" if profile.gpu is not None else "cpu")
    param_bytes = _PARAM_BYTES[args.param_dtype]
    budget: float | None = None
    if kind == "cpu" and profile.cpu_device is None:
        raise ProfileError("cannot plan for CPU tensors: the profile has no device-step rates for CPU tensors (its "
                           "probe measured for CUDA parameters only)")
    if kind == "cuda":
        if profile.gpu is None:
            raise ProfileError(f"cannot plan for CUDA: the profile has no GPU figures ({profile.gpu_unavailable})")
        if args.memory_budget is not None:
            budget = args.memory_budget * 2**30
        else:
            # The offloaded weights and their gradients stay on the device; activations are not known here.
            budget = max(0.0, MEMORY_BUDGET_FRACTION * profile.gpu.free_bytes - 2 * param_bytes * params)
    return Workload(shapes=shapes_for_param_count(int(params)), step_time_s=step_time, param_bytes=param_bytes,
                    grad_dtype=args.grad_dtype, device=kind, memory_budget_bytes=budget)


def _targets(args: argparse.Namespace) -> Targets:
    return Targets(max_loss_ratio=args.max_loss_ratio, stall_fraction=args.target_stall,
                   max_update_interval=args.max_update_interval, min_topk_ratio=args.min_topk_ratio or 0.0,
                   select_windows=DEFAULT_SELECT_WINDOWS)


def _plans(profile: Profile, args: argparse.Namespace, quality: QualityTable) -> list[tuple[Workload, Plan]]:
    targets = _targets(args)
    if args.params is not None:
        models = [(float(args.params), float(args.step_time))]
    else:
        kind = args.device if args.device != "auto" else ("cuda" if profile.gpu is not None else "cpu")
        models = _EXAMPLES[kind]
    out = []
    for params, step_time in models:
        w = _workload(profile, args, params, step_time)
        out.append((w, plan_accumulate(profile, w, accumulate=args.accumulate, targets=targets, quality=quality)))
    return out


# ----------------------------------------------------------------------------------------------- table




# ------------------------------------------------------------------------------------------------ plot


# ------------------------------------------------------------------------------------------------ main


def _calmer_saved(target: Path, profile: Profile) -> Profile | None:
    """The profile saved at ``target`` if it is this machine's and was measured calmer (a lower median spread,
    :attr:`Profile.noise`) than ``profile``; None when there is none, it cannot be read, nothing says it is calmer
    (a schema-1 file recorded no spread), or it lacks figures ``profile`` has (GPU, CPU-tensor device step)."""
    try:
        saved = load_profile(target)
    except ProfileError:
        return None
    if saved.machine_key != profile.machine_key or saved.noise is None or profile.noise is None:
        return None
    if (saved.gpu is None and profile.gpu is not None) or (saved.cpu_device is None and profile.cpu_device is not None):
        return None  # the new one measured what the saved one lacks
    return saved if saved.noise < profile.noise else None


def main(argv: Sequence[str] | None = None) -> int:
    parser = build_parser()
    args = parser.parse_args(argv)
    if args.max_params and (args.params is not None or args.step_time is not None):
        parser.error("--max-params answers for every model size: leave out --params and --step-time")
    if args.max_params or (args.params is not None and args.step_time is None):
        return _capacity(args)
    if args.params is None and args.step_time is not None:
        parser.error("--step-time needs --params")
    if args.load is not None and (args.output is not None or args.no_save or args.quick or args.force):
        parser.error("--load reads a saved profile; --quick, --output, --no-save and --force apply to measuring")
    if args.plot is not None:
        try:
            import matplotlib  # noqa: F401
        except ImportError:
            _err("--plot needs matplotlib: pip install -e '.[plot]' from the checkout")
            return EXIT_MISSING_DEPENDENCY

    try:
        quality = quality_table_for(args.quality_table).for_regime(args.quality_regime)
    except QualityTableError as exc:
        _err(str(exc))
        return EXIT_BAD_QUALITY_TABLE

    def progress(msg: str) -> None:
        if not args.quiet:
            print(f"[{time.perf_counter() - started:6.1f} s] {msg}", file=sys.stderr, flush=True)

    started = time.perf_counter()
    saved: Path | None = None
    if args.load is not None:
        try:
            path = Path(args.load).expanduser() if args.load else default_profile_path()
            profile = load_profile(path)
        except ProfileError as exc:
            _err(f"{exc}; run `python -m zenflow_triton.autotune` to measure one")
            return EXIT_NO_PROFILE
        progress(f"loaded {path}")
    else:
        from .probes import ProbeSettings

        settings = ProbeSettings.quick_settings() if args.quick else ProbeSettings.full_settings()
        settings = settings.with_overrides(adamw_numel=args.adamw_numel, max_copy_bytes=args.max_copy_bytes)
        progress(f"measuring ({settings.describe()}"
                 + ("; --quick measures less, in a few seconds)" if not args.quick else ")"))
        try:
            profile = probe_machine(settings, progress=progress)
        except (RuntimeError, OSError, ValueError, ImportError) as exc:
            _err(f"measurement failed: {exc}")
            return EXIT_PROBE_FAILED
        progress(f"measured in {time.perf_counter() - started:.1f} s")

    try:
        plans = _plans(profile, args, quality)
    except ProfileError as exc:
        _err(str(exc))
        return EXIT_NO_PROFILE

    single = args.params is not None
    auto_reads = default_profile_path(profile.machine_key)  # where "auto" looks on this machine
    where: list[str] = []
    if args.load is not None:
        where.append(f"profile loaded from {path}")
    elif args.no_save:
        where.append(f'profile not saved (--no-save); "auto" reads {auto_reads} if it exists, else measures quickly')
    else:
        target = args.output if args.output is not None else auto_reads
        calmer = None if args.force else _calmer_saved(target, profile)
        if calmer is not None:
            where.append(f"profile not saved: {target} holds one measured calmer (median spread {calmer.noise:.0%}, "
                         f"this run {profile.noise:.0%}), which stays; --force replaces it")
            _err(where[-1])
        else:
            extra: dict[str, Any] = {}
            if single:
                extra["plan"] = plans[0][1].to_dict()
            try:
                saved = save_profile(profile, target, extra=extra)
            except OSError as exc:
                _err(f"cannot write the profile to {target}: {exc.strerror or exc}")
                return EXIT_WRITE_FAILED
            progress(f"profile written to {saved}")
            where.append(f"profile written to {saved}")
        if Path(target).expanduser().resolve() == auto_reads.expanduser().resolve():
            named = f" (named by ${ENV_VAR})" if os.environ.get(ENV_VAR) else ""
            where.append(f'"auto" (topk_ratio="auto", update_interval="auto") reads it from there{named}')
        else:
            where.append(f'"auto" reads {auto_reads}, not this file: run training with '
                         f"{ENV_VAR}={Path(target).expanduser().resolve()} in its environment to use it")

    if args.plot is not None:
        # The plot needs one model: the one given, else the middle example.
        workload, chosen = plans[0] if single else plans[len(plans) // 2]
        try:
            plot(args.plot, profile, workload, chosen, quality, _targets(args))
        except OSError as exc:
            _err(f"cannot write the plot to {args.plot}: {exc.strerror or exc}")
            return EXIT_WRITE_FAILED
        progress(f"plot written to {args.plot}")

    if args.json:
        doc = {
            "profile_path": None if saved is None else str(saved),
            "profile_note": where,
            "busy": profile.busy(),
            "profile": profile.to_dict(),
            "quality_table": {"source": quality.source, "task": quality.task, "command": quality.command},
            "plans": [dict(p.to_dict(), params=w.numel, step_time_s=w.step_time_s, device=w.device,
                           memory=memory_rows(w, p)) for w, p in plans],
        }
        print(json.dumps(doc, indent=2))
    else:
        shown = args.load is None or args.show_profile  # measured now: the figures; loaded: once asked
        print(render(profile, plans, saved, single, quality, where, show_profile=shown))
    return EXIT_OK


if __name__ == "__main__":
    sys.exit(main())
