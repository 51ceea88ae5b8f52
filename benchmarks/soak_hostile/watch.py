"""What watches the hostile tenant: the API's memory, Postgres's connections, its batches."""

from __future__ import annotations

import json
import statistics
import threading
from collections import Counter
from collections.abc import Callable
from dataclasses import dataclass
from typing import Any

from cli.perf.service import memory_kb
from testkit.service.soak_checks import Api, BatchRecord, Tracker


@dataclass(frozen=True, slots=True)
class MemorySample:
    t: float
    pid: int
    rss_kib: int
    hwm_kib: int  # VmHWM: the most the process held at any time before this sample
    active: bool  # the large-body senders at work


class ApiMemory:
    """The API process's RSS and high-water mark every time :meth:`sample` is called (the
    stack's own sampler reads every process's RSS every few seconds; the high-water mark
    catches a peak between two samples), each marked with whether the large-body senders
    were at work."""

    def __init__(self, pid: Callable[[], int | None], clock: Callable[[], float],
                 active: Callable[[], bool]):  # fmt: skip
        self.pid = pid
        self.clock = clock
        self.active = active
        self.samples: list[MemorySample] = []
        self.lock = threading.Lock()

    def sample(self) -> None:
        pid = self.pid()
        if pid is None:
            return
        active = self.active()
        got = memory_kb(pid)
        if got is None:
            return
        with self.lock:
            self.samples.append(MemorySample(self.clock(), pid, got[0], got[1], active))

    def snapshot(self) -> list[MemorySample]:
        with self.lock:
            return list(self.samples)


class PgSampler:
    """Postgres's view of the service's connections (``pg_stat_activity`` on the soak's
    database, read straight, not through the cut-able proxy): how many are idle inside a
    transaction, sampled with the number of slow uploads open at the time."""

    def __init__(self, url: str, clock: Callable[[], float], slow_open: Callable[[], int]):
        from sqlalchemy import create_engine

        self.engine = create_engine(url, pool_size=1, max_overflow=0)
        self.clock = clock
        self.slow_open = slow_open
        self.samples: list[tuple[float, int, int, int]] = []  # t, idle in tx, all, slow open

    def sample(self) -> None:
        from sqlalchemy import text

        try:
            with self.engine.connect() as conn:
                rows = conn.execute(
                    text(
                        "SELECT state, count(*) FROM pg_stat_activity "
                        "WHERE datname = current_database() AND pid <> pg_backend_pid() "
                        "GROUP BY state"
                    )
                ).all()
        except Exception:  # the database restarting: no sample
            return
        states = {str(state): int(n) for state, n in rows}
        self.samples.append(
            (self.clock(), states.get("idle in transaction", 0), sum(states.values()),
             self.slow_open())
        )  # fmt: skip

    def report(self) -> dict[str, Any]:
        def summary(rows: list[tuple[float, int, int, int]]) -> dict[str, Any] | None:
            if not rows:
                return None
            idle = [r[1] for r in rows]
            return {"samples": len(rows), "idle_in_transaction_median": statistics.median(idle),
                    "idle_in_transaction_max": max(idle),
                    "connections_max": max(r[2] for r in rows)}  # fmt: skip

        return {
            "with_slow_uploads_open": summary([r for r in self.samples if r[3] > 0]),
            "without": summary([r for r in self.samples if r[3] == 0]),
            "slow_uploads_open_max": max((r[3] for r in self.samples), default=0),
        }

    def close(self) -> None:
        self.engine.dispose()


class HostileTracker(Tracker):
    """The hostile tenant's batches: polled like the others, but when one ends only the size
    of its files is checked: output and error lines together at most ``min(lines in its
    file, max_requests_per_batch) + 1``."""

    def __init__(self, api: Api, clock: Callable[[], float], poll_s: float, max_requests: int):
        super().__init__(api, clock, poll_s, expiry_grace_s=0.0)
        self.max_requests = max_requests
        self.file_lines: dict[str, int] = {}
        self.file_results: dict[str, dict[str, int]] = {}
        self.bound_violations: list[dict[str, Any]] = []

    def add_batch(self, record: BatchRecord, file_lines: int) -> None:
        self.file_lines[record.id] = file_lines
        self.add(record)

    def bound(self, batch_id: str) -> int:
        return min(self.file_lines.get(batch_id, self.max_requests), self.max_requests) + 1

    def _count(self, record: BatchRecord, file_id: str | None) -> tuple[int, Counter] | None:
        if file_id is None:
            return 0, Counter()
        r = self.api.call(
            record.tenant, "GET", f"/v1/files/{file_id}/content", "GET /v1/files/{id}/content"
        )
        if r is None or r.status_code != 200:
            return None
        codes: Counter = Counter()
        lines = 0
        for raw in r.text.splitlines():
            if not raw.strip():
                continue
            lines += 1
            try:
                line = json.loads(raw)
                error = line.get("error") or {}
                code = error.get("code") if isinstance(error, dict) else None
                codes[str(code) if code else "output"] += 1
            except ValueError:
                codes["unreadable"] += 1
        return lines, codes

    def _check_lines(self, record: BatchRecord) -> None:
        record.check_attempts += 1
        out = self._count(record, record.output_file_id)
        err = self._count(record, record.error_file_id)
        if out is None or err is None:
            return
        record.checked = True
        record.outputs = out[0]
        record.error_codes = err[1]
        total = out[0] + err[0]
        self.file_results[record.id] = {"output_lines": out[0], "error_lines": err[0]}
        if total > self.bound(record.id):
            self.bound_violations.append(
                {"batch": record.id, "kind": record.kind, "status": record.status,
                 "file_lines": self.file_lines.get(record.id), "output_lines": out[0],
                 "error_lines": err[0], "bound": self.bound(record.id)}
            )  # fmt: skip

    def _check_overdue(self) -> None:
        pass  # 24 h windows: nothing to expire
