"""The engine host's request counters, and the :class:`HostStats` snapshot they make."""

from __future__ import annotations

from collections.abc import Iterable
from dataclasses import dataclass

from engine.core.outputs import EngineStats, HostStats
from engine.host.entry import Entry


@dataclass(slots=True)
class Counters:
    """What the host did since it started; written under its lock or on its loop thread."""

    submitted: int = 0
    completed: int = 0
    aborted: int = 0
    failed: int = 0
    step_errors: int = 0
    steps: int = 0
    suspended: int = 0  # in-flight requests suspended for another tenant's share or urgent work
    base_steps: int | None = None  # engine counters when the host started, for its own means
    base_running_seq_steps: int = 0

    def snapshot(
        self,
        engine_stats: EngineStats,
        *,
        pending: int,
        in_flight: int,
        max_num_seqs: int,
        max_pending: int,
        max_in_flight: int,
    ) -> HostStats:
        """The host's stats beside ``engine_stats``; its mean occupancy counts only the steps
        since the host started."""
        occupancy = 0.0
        if self.base_steps is not None and max_num_seqs > 0:
            steps = engine_stats.num_steps - self.base_steps
            seq_steps = engine_stats.total_running_seq_steps - self.base_running_seq_steps
            if steps > 0:
                occupancy = seq_steps / steps / max_num_seqs
        return HostStats(
            engine=engine_stats,
            pending=pending,
            in_flight=in_flight,
            submitted=self.submitted,
            completed=self.completed,
            aborted=self.aborted,
            failed=self.failed,
            step_errors=self.step_errors,
            steps=self.steps,
            suspended=self.suspended,
            mean_occupancy=occupancy,
            max_pending=max_pending,
            max_in_flight=max_in_flight,
        )


def count_requests(entries: Iterable[Entry]) -> int:
    """How many of ``entries`` are requests of their own: the completions of a split request
    are counted once, when the request settles (``EngineHost._settle``)."""
    return sum(1 for e in entries if e.fanout is None)
