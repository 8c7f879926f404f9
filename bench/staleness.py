"""How far a one-update delay lowers the step size at which Adam's momentum stays stable: a linear analysis.

``overlap=True`` applies each host window one window late (DESIGN §3): the gradient of a window is taken at
parameters that lack the previous window's update. On a quadratic ``f(x) = h x^2 / 2`` with the preconditioner
frozen (Adam near a minimum, ``a = lr h / sqrt(v)``), Adam's update is heavy-ball momentum in EMA form,

    m_{t+1} = beta m_t + (1 - beta) h x_{t-d},    x_{t+1} = x_t - lr m_{t+1} / sqrt(v),

with ``d`` the delay in updates (0: AdamW; 1: a window one window late). Its iteration matrix is stable for
``a < threshold(beta, d)``; without delay the threshold is ``(2 + 2 beta) / (1 - beta)`` (38 at beta = 0.9), the
"edge of stability" adaptive methods train at, and one update of delay lowers it to 1 at every beta. Predicting the
parameters one update ahead (``x_{t-1} + gamma (x_{t-1} - x_{t-2})`` in place of ``x_{t-1}``) recovers at most
about 3 (gamma ~ 1.5). That is why a stale host step costs quality on a from-scratch run (bench/quality_fair.py's
``--late`` reference, bench/results/quality-fair-2026-12-02.md) and why a smaller one (``host_lr_scale`` < 1) helps
with overlap but not without it::

    python bench/staleness.py
"""

from __future__ import annotations

import argparse

import numpy as np

__all__ = ["iteration_matrix", "threshold", "main"]


def iteration_matrix(a: float, beta: float, delay: int, gamma: float = 0.0) -> np.ndarray:
    """The linear map of the state ``(x_t, ..., x_{t-delay-1}, m_t)`` over one update (``a = lr h / sqrt(v)``)."""
    n = delay + 2
    out = np.zeros((n + 1, n + 1))
    for k in range(n + 1):
        s = np.zeros(n + 1)
        s[k] = 1.0
        xs, m = s[:n], s[n]
        seen = xs[delay] + gamma * (xs[delay] - xs[delay + 1])  # where the gradient is taken
        m_next = beta * m + (1.0 - beta) * seen
        out[:, k] = np.concatenate([[xs[0] - a * m_next], xs[:-1], [m_next]])
    return out


def _stable(a: float, beta: float, delay: int, gamma: float) -> bool:
    return float(max(abs(np.linalg.eigvals(iteration_matrix(a, beta, delay, gamma))))) < 1.0 - 1e-12


def threshold(beta: float, delay: int, gamma: float = 0.0, *, hi: float = 1e3) -> float:
    """The largest stable ``a`` (bisection in log space to ~1e-9 relative; the stable set is an interval from 0)."""
    lo = 1e-6
    if not _stable(lo, beta, delay, gamma):
        return 0.0
    for _ in range(80):
        mid = (lo * hi) ** 0.5
        lo, hi = (mid, hi) if _stable(mid, beta, delay, gamma) else (lo, mid)
    return lo


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--betas", type=float, nargs="+", default=[0.9, 0.8, 0.5, 0.0])
    parser.add_argument("--gammas", type=float, nargs="+", default=[0.0, 1.0, 1.5, 2.0])
    args = parser.parse_args(argv)
    cols = ["no delay"] + [f"delay 1, gamma {g:g}" for g in args.gammas]
    print("| beta1 | " + " | ".join(cols) + " |")
    print("|---" * (len(cols) + 1) + "|")
    for beta in args.betas:
        row = [threshold(beta, 0)] + [threshold(beta, 1, g) for g in args.gammas]
        print(f"| {beta:g} | " + " | ".join(f"{x:.3g}" for x in row) + " |")
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
