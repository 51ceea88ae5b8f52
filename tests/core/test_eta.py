"""The projections' arithmetic (core.eta.forecast): throughput over a window, the work ahead
of a batch under tiers, fair shares and earliest deadline first, and a running batch's own
rate."""

from __future__ import annotations

import pytest

from core.eta import forecast
from core.eta.forecast import Queued, Span

NOW = 10_000.0


def test_throughput_is_work_over_busy_time_not_wall_time():
    # Two batches, 100 s each, back to back with a 100 s idle gap: the idle time is not held
    # against the model.
    spans = [Span(NOW - 300, NOW - 200, 1000), Span(NOW - 100, NOW, 3000)]
    assert forecast.throughput(spans, now=NOW, window_s=900) == pytest.approx(4000 / 200)


def test_throughput_prorates_a_span_cut_by_the_window():
    # Half of the span lies inside the window: half of its work counts.
    spans = [Span(NOW - 200, NOW, 2000)]
    assert forecast.throughput(spans, now=NOW, window_s=100) == pytest.approx(1000 / 100)


def test_overlapping_spans_add_their_work_over_their_union():
    spans = [Span(NOW - 100, NOW, 1000), Span(NOW - 50, NOW, 1000)]
    assert forecast.throughput(spans, now=NOW, window_s=900) == pytest.approx(2000 / 100)


def test_no_history_is_no_rate():
    assert forecast.throughput([], now=NOW, window_s=900) is None
    assert forecast.throughput([Span(NOW - 0.5, NOW, 10)], now=NOW, window_s=900) is None
    assert forecast.throughput([Span(NOW - 50, NOW, 0)], now=NOW, window_s=900) is None
    assert forecast.throughput([Span(NOW - 5000, NOW - 4000, 99)], now=NOW, window_s=900) is None


def test_work_ahead_counts_higher_tiers_and_own_earlier_deadlines_in_full():
    queue = [
        Queued("t", rank=0, deadline=NOW + 99999, remaining=100),  # higher tier
        Queued("t", rank=1, deadline=NOW + 100, remaining=200),  # own, earlier deadline
        Queued("t", rank=1, deadline=NOW + 9999, remaining=400),  # own, later: behind
        Queued("u", rank=2, deadline=NOW, remaining=800),  # lower tier: waits
    ]
    ahead = forecast.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=50)
    assert ahead.before == 300
    assert ahead.total == 300


def test_other_tenants_share_the_model_until_this_batch_ends():
    queue = [Queued("u", 1, NOW, 1000), Queued("v", 1, NOW, 30)]
    ahead = forecast.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=100)
    # Nothing runs before it; u runs beside it for as much as it runs (100), v its 30.
    assert ahead.before == 0
    assert ahead.total == 130
    # With 200 of its own tenant ahead, the others take their share of that time too.
    queue.append(Queued("t", 1, NOW, 200))
    ahead = forecast.work_ahead(queue, tenant="t", rank=1, deadline=NOW + 3600, work=100)
    assert ahead.before == 200 + 200 + 30
    assert ahead.total == 200 + 300 + 30


def test_project_and_at_risk():
    ahead = forecast.Ahead(before=1000, total=1500)
    p = forecast.project(ahead, 500, 100.0, NOW)
    assert p == forecast.Projection(start=NOW + 10, finish=NOW + 20)
    assert forecast.project(ahead, 500, None, NOW) is None
    assert forecast.at_risk(p.finish, deadline=NOW + 19)
    assert not forecast.at_risk(p.finish, deadline=NOW + 20)
    assert not forecast.at_risk(None, deadline=NOW)


def test_from_progress_extrapolates_the_batch_own_rate():
    # A quarter done in 30 s at a steady rate: three quarters more take 90 s.
    shards = [Span(NOW - 30, NOW, 250)]
    assert forecast.from_progress(NOW - 30, 250, 1000, NOW, shards, max_window_s=900) == (
        pytest.approx(NOW + 90)
    )
    assert forecast.from_progress(NOW - 30, 0, 1000, NOW, [], max_window_s=900) is None
    assert forecast.from_progress(None, 10, 1000, NOW, [], max_window_s=900) is None
    assert forecast.from_progress(NOW - 0.1, 10, 1000, NOW, [], max_window_s=900) is None
    assert forecast.from_progress(NOW - 30, 10, 0, NOW, [], max_window_s=900) is None


def test_retired_spreads_each_shard_over_its_span_and_cuts_it_to_the_window():
    shards = [
        Span(NOW - 100, NOW - 60, 400),  # ended before the window: nothing of it
        Span(NOW - 60, NOW - 20, 400),  # half of it inside [NOW - 40, NOW]
        Span(NOW - 10, NOW + 50, 100),  # still running: its span ends now, all of it inside
        Span(NOW - 30, NOW, 0),  # released, nothing committed yet
    ]
    assert forecast.retired(shards, low=NOW - 40, now=NOW) == pytest.approx(200 + 100)
    assert forecast.retired([], low=NOW - 40, now=NOW) == 0


def test_recent_window_is_the_later_part_of_the_run_within_bounds():
    assert forecast.recent_window_s(200, max_window_s=900) == pytest.approx(
        200 * forecast.RECENT_FRACTION
    )
    # Never shorter than RECENT_MIN_S, unless the run itself is shorter.
    assert forecast.recent_window_s(12, max_window_s=900) == pytest.approx(forecast.RECENT_MIN_S)
    assert forecast.recent_window_s(4, max_window_s=900) == pytest.approx(4)
    # A long run's window stops at the cap.
    assert forecast.recent_window_s(36_000, max_window_s=900) == pytest.approx(900)


def test_own_rate_blends_the_recent_window_with_the_whole_run():
    # 100 s of run: 500 tokens in the first half (10/s, e.g. while its share ramped up),
    # 1000 in the second (20/s): the window is the second half.
    shards = [Span(NOW - 100, NOW - 50, 500), Span(NOW - 50, NOW, 1000)]
    whole, recent = 1500 / 100, 1000 / 50
    w = forecast.RECENT_WEIGHT
    rate = forecast.own_rate(NOW - 100, 1500, shards, NOW, max_window_s=900)
    assert rate == pytest.approx(w * recent + (1 - w) * whole)
    assert whole < rate < recent
    # The projection follows: 1500 left at that rate, earlier than at the whole-run rate.
    finish = forecast.from_progress(NOW - 100, 1500, 3000, NOW, shards, max_window_s=900)
    assert finish == pytest.approx(NOW + 1500 / rate)
    assert finish < NOW + 1500 / whole
    # Shards that ended before the window change nothing, so callers may leave them out.
    assert forecast.own_rate(NOW - 100, 1500, shards[1:], NOW, max_window_s=900) == rate


def test_a_batch_that_retired_nothing_lately_slows_down_but_keeps_a_projection():
    # All its work came in its first 40 s; the last 60 s (its window) retired nothing: its rate
    # is the whole-run rate's share only, so the projection moves later, not to "unknown".
    shards = [Span(NOW - 120, NOW - 80, 600), Span(NOW - 60, NOW, 0)]
    rate = forecast.own_rate(NOW - 120, 600, shards, NOW, max_window_s=900)
    assert rate == pytest.approx((1 - forecast.RECENT_WEIGHT) * 600 / 120)
    # A cap on the window: the last 30 s only.
    assert forecast.recent_window_s(120, max_window_s=30) == 30
