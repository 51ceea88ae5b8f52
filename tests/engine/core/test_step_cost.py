"""The measured step-cost curve and the room it leaves beside urgent work."""

from __future__ import annotations

import math

import pytest

from engine.core.step_cost import StepCostCurve


def _curve(cost, counts=range(1, 33), max_num_seqs: int = 32) -> StepCostCurve:
    curve = StepCostCurve(max_num_seqs)
    for n in counts:
        curve.observe(n, n, cost(n))
    return curve


def test_a_flat_curve_holds_nothing_back() -> None:
    """An accelerator's decode step costs the same for 1 or 32 sequences: every free slot."""
    curve = _curve(lambda n: 0.010)
    assert curve.room(16, 1.25, 16) == 16


def test_a_linear_curve_leaves_what_keeps_the_step_within_the_slowdown() -> None:
    curve = _curve(lambda n: 0.010 + 0.001 * n)  # 26 ms at 16; 1.25x is 32.5 ms, at 22.5 seqs
    a, b = curve.line()
    assert a == pytest.approx(0.010) and b == pytest.approx(0.001)
    assert curve.room(16, 1.25, 16) == 6
    assert curve.room(16, 1.0, 16) == 0
    assert curve.room(16, 1.25, 3) == 3  # never past the free slots
    assert curve.room(16, math.inf, 16) == 16


def test_the_measured_curve_wins_over_its_line_where_it_steepens() -> None:
    """Flat to 16, then steep (a CPU step past its cache-friendly size): the line through all
    points would allow more than the measured points do."""
    curve = _curve(lambda n: 0.020 if n <= 16 else 0.020 + 0.004 * (n - 16))
    assert curve.room(16, 1.25, 16) == 1  # 24 ms at 17 fits 25 ms; 28 ms at 18 does not
    assert curve.room(4, 1.25, 28) == 13  # up to 17 sequences in all


def test_counts_between_measured_ones_are_interpolated() -> None:
    curve = _curve(lambda n: 0.010 + 0.001 * n, counts=(1, 8, 16, 32))
    assert curve.estimate(12) == pytest.approx(0.022)
    assert curve.room(16, 1.25, 16) == 6


def test_prefill_steps_are_not_decode_costs() -> None:
    curve = StepCostCurve(32)
    curve.observe(16, 16 * 30, 1.0)  # a step carrying prefill chunks
    assert curve.estimate(16) is None


def test_the_curve_cannot_tell_until_its_counts_span_a_quarter_of_the_slots() -> None:
    curve = _curve(lambda n: 0.001 * n, counts=(30, 31, 32))
    assert curve.line() is None
    assert curve.room(16, 1.25, 16) == 16  # no guess: nothing is held back
    curve.observe(24, 24, 0.024)
    assert curve.line() is not None
    assert curve.room(16, 1.25, 16) < 16


def test_a_moving_average_follows_a_changing_machine() -> None:
    curve = StepCostCurve(8)
    curve.observe(4, 4, 0.010)
    for _ in range(60):
        curve.observe(4, 4, 0.020)
    assert curve.estimate(4) == pytest.approx(0.020, rel=0.01)
