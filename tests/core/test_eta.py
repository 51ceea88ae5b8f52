"""The projections' arithmetic (core.eta): throughput over a window, the work ahead of a batch
under tiers, fair shares and earliest deadline first, and a running batch's own rate."""

from __future__ import annotations

import pytest

from core import eta
from core.eta import Queued, Span

NOW = 10_000.0


def test_throughput_is_work_over_busy_time_not_wall_time():
    # Two batches, 100 s each, back to back with a 100 s idle gap: the idle time is not held
    # against the model.
    spans = [Span(NOW - 300, NOW - 200, 1000), Span(NOW - 100, NOW, 3000)]
    assert eta.throughput(spans, now=NOW, window_s=900) == pytest.approx(4000 / 200)


def test_throughput_prorates_a_span_cut_by_the_window():
    # Half of the span lies inside the window: half of its work counts.
    spans = [Span(NOW - 200, NOW, 2000)]
    assert eta.throughput(spans, now=NOW, window_s=100) == pytest.approx(1000 / 100)


def test_overlapping_spans_add_their_work_over_their_union():
    spans = [Span(NOW - 100, NOW, 1000), Span(NOW - 50, NOW, 1000)]
    assert eta.throughput(spans, now=NOW, window_s=900) == pytest.approx(2000 / 100)


def test_no_history_is_no_rate():
    assert eta.throughput([], now=NOW, window_s=900) is None
    assert eta.throughput([Span(NOW - 0.5, NOW, 10)], now=NOW, window_s=900) is None
    assert eta.throughput([Span(NOW - 50, NOW, 0)], now=NOW, window_s=900) is None
    assert eta.throughput([Span(NOW - 5000, NOW - 4000, 99)], now=NOW, window_s=900) is None


def test_work_ahead_counts_higher_tiers_and_own_earlier_deadlines_in_full():
    queue = [
        Queued("t", rank=0, deadline=NOW + 99999, remaining=100),  # higher tier
        Queued("t", rank=1, deadline=NOW + 100, remaining=200),  # own, earlier deadline
        Queued("t", rank=1, deadline=NOW + 9999, remaining=400),  # own, later: behind
        Queued("u", rank=2, deadline=NOW, remaining=800),  # lower tier: waits
    ]
    ahead = eta.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=50)
    assert ahead.before == 300
    assert ahead.total == 300


def test_other_tenants_share_the_model_until_this_batch_ends():
    queue = [Queued("u", 1, NOW, 1000), Queued("v", 1, NOW, 30)]
    ahead = eta.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=100)
    # Nothing runs before it; u runs beside it for as much as it runs (100), v its 30.
    assert ahead.before == 0
    assert ahead.total == 130
    # With 200 of its own tenant ahead, the others take their share of that time too.
    queue.append(Queued("t", 1, NOW, 200))
    ahead = eta.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=100)
    assert ahead.before == 200 + 200 + 30
    assert ahead.total == 200 + 300 + 30


def test_project_and_at_risk():
    ahead = eta.Ahead(before=1000, total=1500)
    p = eta.project(ahead, 500, 100.0, NOW)
    assert p == eta.Projection(start=NOW + 10, finish=NOW + 20)
    assert eta.project(ahead, 500, None, NOW) is None
    assert eta.at_risk(p.finish, deadline=NOW + 19)
    assert not eta.at_risk(p.finish, deadline=NOW + 20)
    assert not eta.at_risk(None, deadline=NOW)


def test_from_progress_extrapolates_the_batch_own_rate():
    # A quarter done in 30 s: three quarters more take 90 s.
    assert eta.from_progress(NOW - 30, 250, 1000, NOW) == pytest.approx(NOW + 90)
    assert eta.from_progress(NOW - 30, 0, 1000, NOW) is None
    assert eta.from_progress(None, 10, 1000, NOW) is None
    assert eta.from_progress(NOW - 0.1, 10, 1000, NOW) is None
