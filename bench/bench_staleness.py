"""bench/staleness.py's linear analysis against closed forms and against iterating the recursion itself."""

from __future__ import annotations

import pytest
import staleness


@pytest.mark.parametrize("beta", [0.0, 0.5, 0.9, 0.99])
def test_no_delay_is_heavy_balls_closed_form(beta: float) -> None:
    assert staleness.threshold(beta, 0) == pytest.approx((2 + 2 * beta) / (1 - beta), rel=1e-6)


def _run(a: float, beta: float, delay: int, gamma: float, steps: int = 10000) -> float:
    """|x| after iterating m = beta m + (1 - beta) x_seen, x -= a m from x = 1 (the recursion, not the matrix)."""
    xs, m = [1.0] * (delay + 2), 0.0
    for _ in range(steps):
        seen = xs[-1 - delay] + gamma * (xs[-1 - delay] - xs[-2 - delay])
        m = beta * m + (1 - beta) * seen
        xs.append(xs[-1] - a * m)
        if abs(xs[-1]) > 1e12:
            break
    return abs(xs[-1])


@pytest.mark.parametrize(("beta", "delay", "gamma"), [(0.9, 0, 0.0), (0.9, 1, 0.0), (0.5, 1, 0.0), (0.9, 1, 1.5)])
def test_threshold_separates_decay_from_growth(beta: float, delay: int, gamma: float) -> None:
    t = staleness.threshold(beta, delay, gamma)
    assert _run(0.95 * t, beta, delay, gamma) < 1e-3
    assert _run(1.05 * t, beta, delay, gamma) > 1e3


def test_one_update_of_delay_costs_adam_most_of_its_stable_range() -> None:
    assert staleness.threshold(0.9, 0) == pytest.approx(38.0, rel=1e-6)
    for beta in (0.0, 0.5, 0.9):
        assert staleness.threshold(beta, 1) <= 1.0 + 1e-6
    best_prediction = max(staleness.threshold(0.9, 1, g) for g in (0.5, 1.0, 1.5, 2.0, 3.0))
    assert 2.5 < best_prediction < 3.5  # extrapolating one update ahead recovers little of 38
