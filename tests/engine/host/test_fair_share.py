"""The fair-share policy on its own: who is due room in a full engine, and whose requests make it."""

from __future__ import annotations

from dataclasses import dataclass

from engine.host.fair_queue import FairQueue
from engine.host.fair_share import plan_shares
from engine.host.policy import GuardPlan, guard_urgent


@dataclass(eq=False)
class _Req:
    tenant: str | None
    group: str | None
    priority: int = 0
    cost: int = 10

    @property
    def flow(self) -> tuple[str | None, str | None, int]:
        return self.tenant, self.group, self.priority


def _queue(*entries: _Req) -> FairQueue:
    queue: FairQueue = FairQueue()
    for entry in entries:
        queue.push(entry)
    return queue


def test_a_tenant_alone_suspends_nothing() -> None:
    running = [_Req("a", "bulk") for _ in range(8)]
    plan = plan_shares(_queue(_Req("a", "bulk")), running, max_num_seqs=8, free_room=0)
    assert plan.candidates == [] and plan.need == 0 and plan.full == frozenset()


def test_a_new_tenant_takes_its_share_from_the_newest_requests_of_the_one_above_it() -> None:
    running = [_Req("a", "bulk") for _ in range(8)]
    waiting = [_Req("b", "small") for _ in range(6)]
    plan = plan_shares(_queue(*waiting), running, max_num_seqs=8, free_room=0)
    # Two tenants, share 4 each: b wants 4, a holds 4 over its share; newest first.
    assert plan.need == 4
    assert plan.candidates == running[::-1][:4]
    assert plan.full == frozenset({"a"})


def test_free_room_is_used_before_anyone_is_suspended() -> None:
    running = [_Req("a", "bulk") for _ in range(6)]
    waiting = [_Req("b", "small") for _ in range(3)]
    plan = plan_shares(_queue(*waiting), running, max_num_seqs=8, free_room=2)
    assert plan.need == 1  # b is due 3 (below its share of 4); 2 fit in the free room
    assert plan.full == frozenset({"a"})


def test_less_urgent_tiers_give_way_first_and_are_due_nothing() -> None:
    low = [_Req("a", "bulk", priority=1) for _ in range(4)]
    normal = [_Req("a", "other") for _ in range(4)]
    running = low[:2] + normal + low[2:]
    urgent = [_Req("b", "urgent", priority=-1) for _ in range(3)]
    plan = plan_shares(_queue(*urgent), running, max_num_seqs=8, free_room=0)
    # Only b has work in the top tier: its share is all 8 seats; it wants 3.
    assert plan.need == 3
    lesser = [e for e in running if e.priority > -1]
    assert plan.candidates == lesser[::-1]


def test_nothing_waiting_plans_nothing() -> None:
    plan = plan_shares(_queue(), [_Req("a", "x")], max_num_seqs=4, free_room=0)
    assert plan.need == 0 and plan.candidates == []


def test_the_urgent_guard_is_idle_without_urgent_work() -> None:
    running = [_Req("a", "bulk") for _ in range(8)]
    plan = guard_urgent(running, 0, lambda peak: 0, GuardPlan(peak=5, allowed=0))
    assert plan.suspend == [] and plan.room is None and plan.peak == 0 and plan.allowed is None


def test_the_urgent_guard_suspends_the_newest_bulk_beyond_its_room() -> None:
    bulk = [_Req("a", "bulk") for _ in range(6)]
    urgent = [_Req("a", "now", priority=-1) for _ in range(2)]
    seen: list[int] = []

    def room_for(peak: int) -> int:
        seen.append(peak)
        return 3

    plan = guard_urgent(bulk + urgent, 2, room_for)
    assert seen == [4]  # 2 in flight + 2 pending
    assert plan.suspend == bulk[::-1][:3] and plan.room == 0 and plan.peak == 4


def test_the_urgent_guard_keeps_the_episodes_peak_as_urgent_work_finishes() -> None:
    bulk = [_Req("a", "bulk") for _ in range(2)]
    urgent = [_Req("a", "now", priority=-1)]
    plan = guard_urgent(bulk + urgent, 0, lambda peak: 6 - peak, GuardPlan(peak=4, allowed=2))
    assert plan.peak == 4 and plan.suspend == [] and plan.room == 0
    plan = guard_urgent(bulk[:1] + urgent, 0, lambda peak: 6 - peak, plan)
    assert plan.room == 1


def test_the_urgent_guards_room_only_grows_within_an_episode() -> None:
    """A wavering estimate (3 slots, then 1) suspends nothing it let in; a larger one (5)
    lets more in."""
    bulk = [_Req("a", "bulk") for _ in range(3)]
    urgent = [_Req("a", "now", priority=-1) for _ in range(2)]
    plan = guard_urgent(bulk + urgent, 0, lambda peak: 3)
    assert plan.suspend == [] and plan.allowed == 3
    plan = guard_urgent(bulk + urgent, 0, lambda peak: 1, plan)
    assert plan.suspend == [] and plan.allowed == 3 and plan.room == 0
    plan = guard_urgent(bulk + urgent, 0, lambda peak: 5, plan)
    assert plan.allowed == 5 and plan.room == 2
    assert guard_urgent(bulk, 0, lambda peak: 0, plan) == GuardPlan()  # the episode is over
