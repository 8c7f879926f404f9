"""Compile the Triton kernels for an H100/H200 (sm_90) on a machine without a GPU, through the real launchers.

Triton's interpreter (how CI runs the kernels) accepts code the GPU compiler rejects; this runs the compiler itself:
frontend, TTGIR passes, LLVM, PTX and the ptxas bundled with triton. Each launcher is called on small CPU tensors
with the kernel object replaced by a recorder, which turns the launch into a compilation for sm_90 of exactly the
variant (dtypes, constexprs, integer specializations) that launch would have built. Nothing runs.

Run by ``tests/test_triton_compile.py`` in a subprocess without ``TRITON_INTERPRET`` (under the interpreter
``@triton.jit`` builds interpreter objects that cannot be compiled). Prints one JSON line: the variants compiled,
with the size of each one's cubin (ptxas ran), and the compile errors. Exit status 3 when this triton's internal
compile API is not the one used here (``create_function_from_signature`` / ``_pack_args``, triton 3.x), so the caller
can tell API drift from a kernel that does not compile.
"""

from __future__ import annotations

import json
import os
import re
import subprocess
import sys
import tempfile
import traceback
from dataclasses import fields, replace
from pathlib import Path

assert os.environ.get("TRITON_INTERPRET") != "1", "run without TRITON_INTERPRET: the interpreter cannot compile"

import torch  # noqa: E402
import triton  # noqa: E402

try:
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource, make_backend
    from triton.runtime.jit import create_function_from_signature
except ImportError as exc:  # pragma: no cover - depends on the installed triton
    print(json.dumps({"api_error": f"{type(exc).__name__}: {exc}", "triton": triton.__version__}))
    sys.exit(3)

from zenflow_triton.kernels import AdamHyperparams, _triton_utils, colnorm, fused_step, merge  # noqa: E402

TARGET = GPUTarget("cuda", 90, 32)
BACKEND = make_backend(TARGET)
compiled: list[dict] = []
errors: list[dict] = []
seen: set[str] = set()
# ZENFLOW_SM90_DUMP=DIR: write each variant's TTGIR and PTX there (NN_kernel.ttgir/.ptx/.variant), numbered as listed.
DUMP_DIR = os.environ.get("ZENFLOW_SM90_DUMP")
if DUMP_DIR:
    Path(DUMP_DIR).mkdir(parents=True, exist_ok=True)


class Recorder:
    """Stands in for a ``@triton.jit`` kernel: ``kernel[grid](*args)`` compiles the variant for sm_90 instead."""

    def __init__(self, name: str, kernel) -> None:
        self.name, self.kernel = name, kernel

    def __getitem__(self, grid):
        def launch(*args, **kwargs):
            kwargs.setdefault("debug", False)
            try:
                binder = create_function_from_signature(self.kernel.signature, self.kernel.params, BACKEND)
                bound, specialization, options = binder(*args, **kwargs)
                options, signature, constexprs, attrs = self.kernel._pack_args(
                    BACKEND, kwargs, bound, specialization, options)
            except Exception:  # the internal API moved: not the kernel's fault
                print(json.dumps({"api_error": traceback.format_exc(limit=3), "triton": triton.__version__}))
                sys.exit(3)
            key = f"{self.name} {specialization} {sorted((k, str(v)) for k, v in kwargs.items())}"
            if key in seen:
                return
            seen.add(key)
            try:
                ck = triton.compile(ASTSource(self.kernel, signature, constexprs, attrs), target=TARGET,
                                    options=options.__dict__)
            except Exception as exc:
                errors.append({"kernel": self.name, "variant": key, "error": f"{type(exc).__name__}: {exc}"[:2000]})
                return
            ptx = ck.asm.get("ptx", "")
            if DUMP_DIR:  # the variant's TTGIR and PTX, to read what the compiler made of it
                stem = Path(DUMP_DIR) / f"{len(compiled):02d}_{self.name}"
                stem.with_suffix(".ttgir").write_text(str(ck.asm.get("ttgir", "")))
                stem.with_suffix(".ptx").write_text(ptx)
                stem.with_suffix(".variant").write_text(key)
            compiled.append({"kernel": self.name, "variant": key, "cubin_bytes": len(ck.asm.get("cubin", b"")),
                             "maxnreg": kwargs.get("maxnreg"),
                             **ptxas_resources(ptx), **memory_ops(ptx)})
            if compiled[-1]["spill_bytes"] or self.name in LOOP_KERNELS:
                loop = streaming_loop(ck.asm.get("cubin", b""))
                compiled[-1]["spills_in_loop"] = None if loop is None else loop[0]
                compiled[-1]["loop_sass"] = None if loop is None else loop[1]
                compiled[-1]["loops_sass"] = None if loop is None else loop[2]
                compiled[-1]["loops_spills"] = None if loop is None else loop[3]

        return launch


def memory_ops(ptx: str) -> dict[str, int]:
    """Global loads and stores in the PTX by width: ``.v4`` (4 x 32 bits, 16 bytes: the compiler proved the alignment
    and contiguity it needs), ``.v2``, and scalar ones (a 32-bit element or less per instruction, or a table read);
    ``ld_before_loop``: the scalar loads ahead of the streaming loop (what a program reads before its first tile)."""
    out = {}
    for op in ("ld", "st"):
        v4, v2 = len(re.findall(rf"\b{op}\.global(?:\.\w+)*\.v4\.", ptx)), len(
            re.findall(rf"\b{op}\.global(?:\.\w+)*\.v2\.", ptx))
        total = len(re.findall(rf"\b{op}\.global\.", ptx))
        out.update({f"{op}_v4": v4, f"{op}_v2": v2, f"{op}_scalar": total - v4 - v2})
    out["ld_before_loop"] = scalar_loads_before_loop(ptx)
    return out


def _merge_spans(spans: list[list[int]]) -> list[list[int]]:
    """Loop spans ``[start, end]`` (a label or address to the last branch back to it), overlapping ones merged."""
    merged: list[list[int]] = []
    for lo, hi in sorted(spans):
        if merged and lo <= merged[-1][1]:
            merged[-1][1] = max(merged[-1][1], hi)
        else:
            merged.append([lo, hi])
    return merged

def scalar_loads_before_loop(ptx: str) -> int | None:
    """Scalar ``ld.global`` lines ahead of the streaming loop: the loop (a span from a label to the last branch back
    to it, overlapping spans merged) holding the most global loads; None without a loop."""
    lines = ptx.splitlines()
    labels = {m.group(1): i for i, line in enumerate(lines) if (m := re.match(r"^(\$\w+):", line))}
    spans: list[list[int]] = []
    for i, line in enumerate(lines):
        m = re.search(r"\bbra(?:\.uni)?\s+(\$\w+);", line)
        if m and labels.get(m.group(1), i) < i:
            spans.append([labels[m.group(1)], i])
    merged = _merge_spans(spans)
    if not merged:
        return None
    is_ld = [bool(re.search(r"\bld\.global\.", line)) for line in lines]
    lo, _ = max(merged, key=lambda span: sum(is_ld[span[0]:span[1] + 1]))
    return sum(1 for line in lines[:lo] if re.search(r"\bld\.global\.", line) and not re.search(r"\.v[24]\.", line))


def ptxas_resources(ptx: str) -> dict[str, int | None]:
    """Registers per thread and spill bytes as ptxas reports them (``ptxas -v``, triton's bundled ptxas; the compiled
    object's own figures need a driver). None where ptxas or its report is not found."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            ptxas = get_ptxas(TARGET.arch).path
        except TypeError:  # older triton: no arch argument
            ptxas = get_ptxas().path
        arch = re.search(r"\.target\s+(sm_\w+)", ptx).group(1)
        with tempfile.TemporaryDirectory() as d:
            src = Path(d) / "k.ptx"
            src.write_text(ptx)
            proc = subprocess.run([ptxas, "-v", f"--gpu-name={arch}", str(src), "-o", str(Path(d) / "k.o")],
                                  capture_output=True, text=True, timeout=300)
        report = proc.stdout + proc.stderr
        regs = re.search(r"Used (\d+) registers", report)
        spill_st = re.search(r"(\d+) bytes spill stores", report)
        spill_ld = re.search(r"(\d+) bytes spill loads", report)
    except Exception:  # noqa: BLE001 - the figures are a report, the compile result stands without them
        return {"n_regs": None, "spill_bytes": None}
    return {"n_regs": int(regs.group(1)) if regs else None,
            "spill_bytes": int(spill_st.group(1)) + int(spill_ld.group(1)) if spill_st and spill_ld else None}


# Kernels whose streaming loop's machine code is counted (``loop_sass``) whether or not they spill.
LOOP_KERNELS = ("fused_step", "fused_steps")


def streaming_loop(cubin: bytes) -> tuple[int, int, list[int], list[int]] | None:
    """``(spill instructions, instructions, instructions of each, spills of each)`` of the streaming loops of the
    machine code (``cuobjdump -sass``, bundled with triton), smallest first: a loop is the span of a backward branch
    (overlapping spans merged), streaming when it holds global loads (the fused steps have one per path: packed Adam,
    whole-tile Adam, no Adam). A spill (``STL``/``LDL``, local memory) outside them is a value parked across a loop
    (ptxas's answer to a register cap), read once per program; inside, per tile. The instructions are the largest
    loop's, what a thread issues per tile on that path (all branches counted). None where cuobjdump is not found or
    fails."""
    try:
        from triton.backends.nvidia.compiler import get_ptxas

        try:
            tool = Path(get_ptxas(TARGET.arch).path).with_name("cuobjdump")
        except TypeError:  # older triton: no arch argument
            tool = Path(get_ptxas().path).with_name("cuobjdump")
        with tempfile.TemporaryDirectory() as d:
            obj = Path(d) / "k.cubin"
            obj.write_bytes(cubin)
            sass = subprocess.run([str(tool), "-sass", str(obj)], capture_output=True, text=True, timeout=300,
                                  check=True).stdout
    except Exception:  # noqa: BLE001 - a report, as ptxas_resources
        return None
    ops = [(int(m.group(1), 16), m.group(2)) for m in re.finditer(r"/\*([0-9a-f]{4,})\*/\s+([^;]*);", sass)]
    spans: list[list[int]] = []
    for addr, text in ops:
        m = re.search(r"\bBRA\S*\s+(?:`\()?(?:\.L_x_\d+\))?\s*(0x[0-9a-f]+)", text)
        if m and int(m.group(1), 16) < addr:
            spans.append([int(m.group(1), 16), addr])
    merged = _merge_spans(spans)
    if not ops:
        return None  # not the listing this parser knows
    bodies = [[t for a, t in ops if lo <= a <= hi] for lo, hi in merged]
    bodies = [b for b in bodies if any("LDG" in t for t in b)]
    if not bodies:
        return 0, 0, []
    per_loop = sorted((len(b), sum(re.search(r"\b(STL|LDL)\b", t) is not None for t in b)) for b in bodies)
    return sum(s for _, s in per_loop), per_loop[-1][0], [n for n, _ in per_loop], [s for _, s in per_loop]


fused_step._fused_step_kernel = Recorder("fused_step", fused_step._fused_step_kernel)
fused_step._fused_steps_kernel = Recorder("fused_steps", fused_step._fused_steps_kernel)
_triton_utils._finish_steps_grouped_kernel = Recorder("finish_steps_grouped",
                                                      _triton_utils._finish_steps_grouped_kernel)
colnorm._column_sumsq_kernel = Recorder("column_sumsq", colnorm._column_sumsq_kernel)
merge._merge_kernel = Recorder("merge", merge._merge_kernel)
_triton_utils._add_partials_kernel = Recorder("add_partials", _triton_utils._add_partials_kernel)
_triton_utils._finish_steps_kernel = Recorder("finish_steps", _triton_utils._finish_steps_kernel)
# ZENFLOW_SM90_UNCAPPED=1: compile the variants with compact state without their register cap, to compare.
if os.environ.get("ZENFLOW_SM90_UNCAPPED") == "1":
    fused_step.STATE_MAXNREG = None
for module in (fused_step, colnorm, merge):
    module.check_launch_device = lambda *a, **k: None  # CPU stand-ins for CUDA tensors: nothing is launched

HP = AdamHyperparams(lr=1e-3, beta1=0.9, beta2=0.999, eps=1e-8, weight_decay=0.01)
HP_FIELDS = {f.name for f in fields(AdamHyperparams)}


def fused(rows: int, cols: int, k: int, dtype: torch.dtype, no_acc: bool = False, **kw) -> None:
    slot = torch.full((cols,), -1, dtype=torch.int32)
    slot[:k] = torch.arange(k, dtype=torch.int32)
    z = torch.zeros
    hp = replace(HP, **{k: kw.pop(k) for k in HP_FIELDS & kw.keys()})
    fused_step.fused_step_(
        z(rows, cols, dtype=dtype), z(rows, cols, dtype=dtype), score=z(cols), slot=slot,
        col_step=torch.ones(cols, dtype=torch.int32), master=z(rows, k), exp_avg=z(rows, k), exp_avg_sq=z(rows, k),
        acc=None if no_acc else z(rows, cols), hp=hp, **kw)


# The variants training builds: every param dtype, with and without selected columns, the first step of a window
# (overwrite, scores into one split) and later ones (accumulate, scores through partials), AdamW and Adam-L2; a
# tall matrix for the multi-split score path.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    fused(256, 384, 40, dtype, accumulate=True)
    fused(256, 384, 0, dtype, accumulate=False, update_score=False)
    column_sumsq_grad = torch.zeros(4096, 256, dtype=dtype)
    colnorm.column_sumsq_(torch.zeros(256), column_sumsq_grad)
    slot = torch.full((384,), -1, dtype=torch.int32)
    slot[:40] = torch.arange(40, dtype=torch.int32)
    merge.merge_(torch.zeros(256, 384, dtype=dtype), torch.zeros(256, 384, dtype=dtype), slot)
    if dtype != torch.float32:  # host_snapshot=False: the fp32 master rounded in the merge
        merge.merge_(torch.zeros(256, 384, dtype=dtype), torch.zeros(256, 384), slot)
fused(8192, 512, 52, torch.bfloat16, accumulate=True, decoupled=False)
# The optimizer's steps count themselves (count_step): stored by the one split, and after a multi-split launch.
fused(64, 4096, 400, torch.bfloat16, accumulate=True, count_step=True)
fused(8192, 512, 52, torch.bfloat16, accumulate=True, count_step=True)


def grouped(dtype: torch.dtype, shapes=((256, 384, 40), (4096, 256, 0)), count_step: bool = True,
            no_acc: bool = False) -> None:
    """One grouped launch per dtype, state (any call with k > 0 or none), alignment (C % 16 and 16-byte tensors) and
    width of offsets: a call with compact state and one without, one tall enough for the finishing launch."""
    from zenflow_triton.kernels.device_ops import FusedStepArgs

    calls = []
    for rows, cols, k in shapes:
        slot = torch.full((cols,), -1, dtype=torch.int32)
        slot[:k] = torch.arange(k, dtype=torch.int32)
        z = torch.zeros
        calls.append(FusedStepArgs(
            param=z(rows, cols, dtype=dtype), grad=z(rows, cols, dtype=dtype), score=z(cols), slot=slot,
            col_step=torch.ones(cols, dtype=torch.int32), master=z(rows, k), exp_avg=z(rows, k),
            exp_avg_sq=z(rows, k), acc=None if no_acc else z(rows, cols), hp=HP, accumulate=not no_acc,
            count_step=count_step))
    fused_step.fused_steps_(calls)


for dtype in (torch.float32, torch.bfloat16, torch.float16):
    grouped(dtype)
for dtype in (torch.float32, torch.bfloat16):
    grouped(dtype, shapes=((256, 384, 0), (4096, 256, 0)))  # nothing selected: the variant without state
grouped(torch.bfloat16, shapes=((256, 100, 10), (96, 200, 0)))  # C % 16 != 0: not ALIGNED
# accumulate="host": no acc (HAS_ACC=False), in every dtype, with the step counted as the optimizer does.
for dtype in (torch.float32, torch.bfloat16, torch.float16):
    fused(256, 384, 40, dtype, no_acc=True, accumulate=False, count_step=True)
    grouped(dtype, no_acc=True)
# 64-bit offsets (R*C past 2^31), compiled on small tensors: nothing runs, only the variant matters.
_narrow = fused_step._wide
fused_step._wide = lambda rows, cols, block_r: True
fused(256, 384, 40, torch.bfloat16, accumulate=True, count_step=True)
grouped(torch.bfloat16)
fused_step._wide = _narrow

print(json.dumps({"triton": triton.__version__, "compiled": compiled, "errors": errors}))
