"""The ordering rules the shard release window and the host's fair queue share
(engine.host.order), as pure functions."""

from __future__ import annotations

from engine.host.order import (
    AGED_DUE,
    NEVER,
    NO_DEADLINE,
    NORMAL,
    aged_tier,
    deadline_key,
    due,
    flow_key,
    share_key,
)

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
    assert due(None, aged=False) is None  # these share their tenant's turn by tokens
    assert due(100.0, aged=True) == due(None, aged=True) == AGED_DUE
    keys = {
        "late": deadline_key(200.0, aged=False),
        "none": deadline_key(None, aged=False),
        "aged": deadline_key(999.0, aged=True),
        "soon": deadline_key(100.0, aged=False),
    }
    assert sorted(keys, key=keys.__getitem__) == ["aged", "soon", "late", "none"]
    assert keys["none"] == NO_DEADLINE


def test_flows_share_by_tokens_then_the_one_served_longest_ago_goes_first() -> None:
    keys = {
        "heavy": share_key(300, last_served=1.0),
        "light-recent": share_key(100, last_served=9.0),
        "light-earlier": share_key(100, last_served=5.0),
        "light-never": share_key(100),
    }
    assert sorted(keys, key=keys.__getitem__) == [
        "light-never", "light-earlier", "light-recent", "heavy"
    ]  # fmt: skip
    assert share_key(0) == (0, NEVER)


def test_the_whole_order_is_tier_then_tenant_share_then_deadline_then_batch_share() -> None:
    idle, busy = share_key(0), share_key(500, 1.0)
    keys = {
        "low-idle": flow_key(LOW, idle, 1.0, False, idle),
        "busy-tenant": flow_key(NORMAL, busy, 1.0, False, idle),
        "late": flow_key(NORMAL, idle, 9.0, False, idle),
        "soon-busy-batch": flow_key(NORMAL, idle, 1.0, False, busy),
        "soon": flow_key(NORMAL, idle, 1.0, False, idle),
        "aged": flow_key(NORMAL, idle, 9.0, True, busy),
        "urgent": flow_key(HIGH, busy, None, False, busy),
    }
    assert sorted(keys, key=keys.__getitem__) == [
        "urgent", "aged", "soon", "soon-busy-batch", "late", "busy-tenant", "low-idle"
    ]  # fmt: skip
