"""CPU seconds of named groups of processes, read from ``/proc`` while a benchmark runs."""

from __future__ import annotations

import contextlib

from cli.procfs import process_cpu_s


class CpuMeter:
    """CPU seconds per named group of processes; a group's processes may come and go (Postgres
    backends do), so each pid's last reading is kept and summed."""

    def __init__(self) -> None:
        self.last: dict[str, dict[int, float]] = {}

    def sample(self, groups: dict[str, list[int]]) -> None:
        for name, pids in groups.items():
            seen = self.last.setdefault(name, {})
            for pid in pids:
                with contextlib.suppress(OSError):  # gone: its last reading stays
                    seen[pid] = process_cpu_s(pid)

    def total(self, name: str) -> float:
        return sum(self.last.get(name, {}).values())

    def totals(self) -> dict[str, float]:
        return {name: self.total(name) for name in self.last}
