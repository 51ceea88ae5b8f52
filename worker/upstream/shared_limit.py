"""One in-flight limit per upstream, shared by every dispatch worker that sends it work.

Each dispatcher reports its demand and cumulative counters every second; the member holding
the upstream's lease (a row of ``upstream_limits``) runs one
:class:`~worker.upstream.concurrency.ConcurrencyController` on everyone's sums, and each member
sends its share, in proportion to its demand. :class:`LocalLimit` is the same arithmetic for
one process without the database.
"""

from __future__ import annotations

import logging
import math
import time
from collections.abc import Callable, Sequence
from dataclasses import dataclass, fields
from datetime import UTC, datetime, timedelta

from sqlalchemy import or_, select, update

from core.database.sessions import session_scope, updated
from core.database.tables import UpstreamLimit, UpstreamMember
from worker.upstream.concurrency import ConcurrencyController, Window

logger = logging.getLogger(__name__)

LEASE_S = 5.0
MEMBER_TTL_S = 5.0
MIN_WINDOW_S = 2.0


@dataclass(slots=True)
class Counters:
    """A dispatcher's cumulative figures (only ever grow)."""

    completed: int = 0
    output_tokens: int = 0
    latency_s: float = 0.0
    busy_s: float = 0.0  # the integral of requests in flight over time
    overloads: int = 0

    def minus(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) - getattr(other, f.name) for f in fields(self)))

    def plus(self, other: Counters) -> Counters:
        return Counters(*(getattr(self, f.name) + getattr(other, f.name) for f in fields(self)))


class Windows:
    """Turns cumulative counters into the controller's windows. A window closes after
    ``MIN_WINDOW_S`` and at least half a limit's worth of completions; the first window after
    the limit changed is let go by (the in-flight count is still moving to the new limit).
    While nothing is waiting or in flight the window restarts, and the first one after work
    resumes is let go by too: a window that spans an idle gap, or the ramp out of one,
    measures the gap, not the limit."""

    def __init__(self, controller: ConcurrencyController, name: str = "") -> None:
        self.controller = controller
        self.name = name  # for the log line of each change
        self._start: Counters | None = None
        self._started_at = 0.0
        self._settling = False
        self._idle = False

    def feed(self, total: Counters, now: float, demand: int | None = None) -> int:
        if self._start is None:
            self._start, self._started_at = total, now
            return self.controller.limit
        if demand == 0:
            self._start, self._started_at = total, now
            if not self._idle:
                self._idle = self._settling = True
                self.controller.idle()
            return self.controller.limit
        self._idle = False
        delta = total.minus(self._start)
        before = self.controller.limit
        window: Window | None = None
        if delta.overloads > 0:
            self.controller.overloaded()
        elif now - self._started_at >= MIN_WINDOW_S and delta.completed >= max(1, before // 2):
            seconds = now - self._started_at
            window = Window(
                seconds=seconds,
                completed=delta.completed,
                output_tokens=delta.output_tokens,
                latency_s=delta.latency_s,
                busy=delta.busy_s / seconds,
            )
            if not self._settling:
                self.controller.observe(window)
        else:
            return before
        self._settling = self.controller.limit != before
        if self._settling:
            logger.info(
                "upstream %s: in-flight limit %s -> %s (%s)",
                self.name,
                before,
                self.controller.limit,
                f"{window.throughput:.1f} output tokens/s at {window.busy:.1f} in flight"
                if window is not None
                else f"{delta.overloads} overloads",
            )
        self._start, self._started_at = total, now
        return self.controller.limit


def share_of(limit: int, demand: int, total_demand: int, members: int = 1) -> int:
    """A member's part of ``limit``: in proportion to its demand, at least 1 while it has
    any, all of it when it is alone. An idle member keeps an even part of the limit, so the
    work that arrives before its next report does not go out one request at a time."""
    if demand <= 0:
        return max(1, limit // max(1, members))
    if total_demand <= demand:
        return limit
    return max(1, math.floor(limit * demand / total_demand))


class LocalLimit:
    """The limit of an upstream that this process alone sends work to."""

    def __init__(self, controller: ConcurrencyController) -> None:
        self.controller = controller
        self.windows = Windows(controller)
        self.limit = controller.limit

    def sync(self, demand: int, counters: Counters) -> int:
        self.limit = self.windows.feed(counters, time.monotonic(), demand)
        return self.limit


class SharedLimit:
    """The limit of ``upstream`` shared through the database by every member that sends it
    work (see the module docstring); ``sync`` returns this member's share."""

    def __init__(
        self,
        upstream: str,
        member: str,
        controller: ConcurrencyController,
        clock: Callable[[], float] = time.monotonic,
    ) -> None:
        self.upstream = upstream
        self.member = member
        self.controller = controller
        self.windows = Windows(controller, upstream)
        self.limit = controller.limit
        self.clock = clock  # when the leader's windows close
        self.leader = False
        self._last: dict[str, Counters] = {}  # each member's counters at the last read
        self._total = Counters()  # the members' summed progress while this one leads

    def sync(self, demand: int, counters: Counters) -> int:
        now = datetime.now(UTC)
        with session_scope() as session:
            row = session.get(UpstreamMember, (self.upstream, self.member))
            if row is None:
                row = UpstreamMember(upstream=self.upstream, member=self.member)
                session.add(row)
            row.seen_at, row.demand = now, demand
            row.completed, row.output_tokens = counters.completed, counters.output_tokens
            row.latency_s, row.overloads = counters.latency_s, counters.overloads
            row.busy_s = counters.busy_s
            state = session.get(UpstreamLimit, self.upstream)
            if state is None:
                session.add(UpstreamLimit(upstream=self.upstream, limit=self.limit, updated_at=now))
        with session_scope() as session:
            took = updated(
                session,
                update(UpstreamLimit)
                .where(
                    UpstreamLimit.upstream == self.upstream,
                    or_(
                        UpstreamLimit.leader == self.member,
                        UpstreamLimit.leader.is_(None),
                        UpstreamLimit.leader_until < now,
                    ),
                )
                .values(leader=self.member, leader_until=now + timedelta(seconds=LEASE_S)),
            )
            if not took and self.leader:
                self.windows = Windows(self.controller, self.upstream)  # another member leads
                self._last.clear()
            if took and not self.leader:
                state = session.get(UpstreamLimit, self.upstream)
                if state is not None and state.updated_at is not None:
                    # What the last leader found is a better start than a guess.
                    self.controller.resume(state.limit)
            self.leader = bool(took)
            members = session.scalars(
                select(UpstreamMember).where(
                    UpstreamMember.upstream == self.upstream,
                    UpstreamMember.seen_at >= now - timedelta(seconds=MEMBER_TTL_S),
                )
            ).all()
            if self.leader:
                limit = self._lead(members, sum(m.demand for m in members))
                session.execute(
                    update(UpstreamLimit)
                    .where(UpstreamLimit.upstream == self.upstream)
                    .values(limit=limit, updated_at=now)
                )
            else:
                state = session.get(UpstreamLimit, self.upstream)
                limit = state.limit if state is not None else self.limit
            others = [m for m in members if m.member != self.member]
            total_demand = sum(m.demand for m in others) + demand
        self.limit = limit
        return share_of(limit, demand, total_demand, len(others) + 1)

    def _lead(self, members: Sequence[UpstreamMember], demand: int) -> int:
        """Sum each member's progress since the last read (a member seen for the first time
        adds nothing: its counters start its baseline) and feed the windows."""
        for m in members:
            now = Counters(m.completed, m.output_tokens, m.latency_s, m.busy_s, m.overloads)
            before = self._last.get(m.member)
            self._last[m.member] = now
            if before is not None and now.completed >= before.completed:
                self._total = self._total.plus(now.minus(before))
        return self.windows.feed(self._total, self.clock(), demand)

    def leave(self) -> None:
        """Drop this member's report and lease (a stopping worker)."""
        with session_scope() as session:
            row = session.get(UpstreamMember, (self.upstream, self.member))
            if row is not None:
                session.delete(row)
            session.execute(
                update(UpstreamLimit)
                .where(UpstreamLimit.upstream == self.upstream, UpstreamLimit.leader == self.member)
                .values(leader=None, leader_until=None)
            )
