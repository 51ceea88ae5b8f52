"""The ordering rules the shard release window and the host's fair queue share
(engine.host.order), as pure functions."""

from __future__ import annotations

from engine.host.order import AGED_DUE, NO_DEADLINE, NORMAL, aged_tier, deadline_key, due

LOW, HIGH = NORMAL + 1, NORMAL - 1


def test_a_bulk_tier_ages_one_tier_once_it_waited_longer_than_the_bound() -> None:
    assert aged_tier(LOW, waiting_since=0.0, now=61.0, aging_s=60.0) == NORMAL
    assert aged_tier(LOW, waiting_since=0.0, now=60.0, aging_s=60.0) == LOW  # not longer
    assert aged_tier(LOW, waiting_since=0.0, now=1e9, aging_s=None) == LOW  # no aging
    assert aged_tier(NORMAL + 3, 0.0, 61.0, 60.0) == NORMAL + 2  # one tier at a time


def test_aging_never_reaches_past_normal() -> None:
    assert aged_tier(NORMAL, 0.0, 1e9, 1.0) == NORMAL
    assert aged_tier(HIGH, 0.0, 1e9, 1.0) == HIGH


def test_earliest_deadline_first_with_aged_batches_first_and_none_last() -> None:
    assert due(100.0, aged=False) == 100.0
    assert due(None, aged=False) is None  # the host's queue shares these by round-robin
    assert due(100.0, aged=True) == due(None, aged=True) == AGED_DUE
    keys = {
        "late": deadline_key(200.0, aged=False),
        "none": deadline_key(None, aged=False),
        "aged": deadline_key(999.0, aged=True),
        "soon": deadline_key(100.0, aged=False),
    }
    assert sorted(keys, key=keys.__getitem__) == ["aged", "soon", "late", "none"]
    assert keys["none"] == NO_DEADLINE
