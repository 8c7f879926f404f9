"""How far bf16 Adam moments drift from fp32 ones: round to nearest even vs the host kernel's stochastic rounding.

    python bench/moment_rounding_drift.py [--numel 65536] [--steps 4000] [--out bench/results/moment-rounding-DATE.md]

Each element sees a gradient stream ``g_t = scale(t) * (mu + z_t)``, ``z_t`` standard normal, a per-element mean
``mu`` ~ N(0, 0.5) and a gradient scale that falls from 1 to 0.25 over the run (gradients shrink as training goes).
The moments follow Adam's recurrences (beta1 0.9, beta2 0.999) in fp32 (the reference), in bf16 stored round to
nearest even after every update, and in bf16 stored with ``reference.bf16_stochastic`` (state_dtype="bfloat16",
the numba kernel's moments equal it bit for bit: tests/test_state_dtype.py). Reported at checkpoints: the mean over
elements of v_bf16 / v_fp32 and of |m_bf16 - m_fp32| / rms(m_fp32), and the relative error of the update direction
m / sqrt(v). With beta2 = 0.999 the decay of v per update (0.1%) is under half a bf16 ulp (0.2-0.4%), so round to
nearest leaves a shrinking v where it was: v stops following the gradients down.
"""

from __future__ import annotations

import argparse
import math
import platform
import sys
import time

import torch

from zenflow_triton.kernels.reference import bf16_stochastic, moment_noise

BETA1, BETA2, EPS = 0.9, 0.999, 1e-8


def run(numel: int, steps: int, seed: int = 0) -> list[dict[str, float]]:
    gen = torch.Generator().manual_seed(seed)
    mu = torch.randn(numel, generator=gen) * 0.5
    index = torch.arange(numel, dtype=torch.int64)
    m32, v32 = torch.zeros(numel), torch.zeros(numel)
    m_rn, v_rn = torch.zeros(numel, dtype=torch.bfloat16), torch.zeros(numel, dtype=torch.bfloat16)
    m_sr, v_sr = m_rn.clone(), v_rn.clone()
    rows = []
    marks = {steps // 8, steps // 4, steps // 2, steps}
    for t in range(1, steps + 1):
        scale = 1.0 - 0.75 * (t - 1) / max(1, steps - 1)
        g = (mu + torch.randn(numel, generator=gen)) * scale
        g2 = g * g
        m32.lerp_(g, 1 - BETA1)
        v32.mul_(BETA2).add_(g2, alpha=1 - BETA2)
        m = m_rn.float().lerp_(g, 1 - BETA1)
        v = v_rn.float().mul_(BETA2).add_(g2, alpha=1 - BETA2)
        m_rn, v_rn = m.to(torch.bfloat16), v.to(torch.bfloat16)
        m = m_sr.float().lerp_(g, 1 - BETA1)
        v = v_sr.float().mul_(BETA2).add_(g2, alpha=1 - BETA2)
        noise = moment_noise(index, torch.tensor(t))
        m_sr, v_sr = bf16_stochastic(m, noise & 0xFFFF), bf16_stochastic(v, noise >> 16)
        if t in marks:
            bc1, bc2 = 1 - BETA1**t, 1 - BETA2**t
            d32 = (m32 / bc1) / ((v32 / bc2).sqrt() + EPS)
            rms_m = m32.pow(2).mean().sqrt()
            row = {"step": t}
            for name, mm, vv in (("nearest", m_rn, v_rn), ("stochastic", m_sr, v_sr)):
                mm, vv = mm.float(), vv.float()
                d = (mm / bc1) / ((vv / bc2).sqrt() + EPS)
                row[f"{name} v ratio"] = float((vv / v32).mean())
                row[f"{name} m err"] = float((mm - m32).abs().mean() / rms_m)
                row[f"{name} dir err"] = float((d - d32).norm() / d32.norm())
            rows.append(row)
    return rows


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--numel", type=int, default=65536)
    ap.add_argument("--steps", type=int, default=4000)
    ap.add_argument("--out", default=None, help="write the markdown table here too")
    args = ap.parse_args(argv)
    start = time.perf_counter()
    rows = run(args.numel, args.steps)
    keys = [k for k in rows[0] if k != "step"]
    lines = ["| step | " + " | ".join(keys) + " |", "|---:|" + "---:|" * len(keys)]
    lines += [f"| {r['step']} | " + " | ".join(f"{r[k]:.4f}" for k in keys) + " |" for r in rows]
    table = "\n".join(lines)
    print(table)
    if args.out:
        cmd = "python bench/moment_rounding_drift.py " + " ".join(argv if argv is not None else sys.argv[1:])
        with open(args.out, "w") as f:
            f.write(f"# bf16 moments: round to nearest even vs stochastic rounding ({time.strftime('%Y-%m-%d')})\n\n")
            f.write(f"Command: `{cmd.strip()}` ({args.numel} elements, {args.steps} Adam updates, "
                    f"{time.perf_counter() - start:.0f} s on {platform.machine()}, torch {torch.__version__}).\n\n")
            f.write(__doc__.split("\n\n", 2)[2].strip() + "\n\n")
            f.write("`v ratio`: mean of v_bf16 / v_fp32 (1 is exact); `m err`: mean |m_bf16 - m_fp32| / rms(m_fp32); "
                    "`dir err`: ||d_bf16 - d_fp32|| / ||d_fp32|| for the bias-corrected update d = m / (sqrt(v) + eps)."
                    "\n\n")
            f.write(table + "\n")
    if not math.isfinite(rows[-1]["stochastic v ratio"]):
        raise SystemExit("non-finite result")


if __name__ == "__main__":
    main()
