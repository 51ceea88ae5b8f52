"""The hostile tenant's phases: the run cut in equal parts, the tenant active in every other one."""

from __future__ import annotations

from dataclasses import asdict, dataclass
from typing import Any


@dataclass(frozen=True, slots=True)
class Phase:
    index: int
    start: float
    end: float
    hostile: bool


class Phases:
    """The run's traffic span ``[t0, t0 + duration)`` cut into ``count`` equal phases; the
    hostile tenant is active in every other one, from the second (quiet, hostile, quiet, ...)."""

    def __init__(self, t0: float, duration: float, count: int):
        count = max(2, count)
        span = duration / count
        self.phases = [
            Phase(i, t0 + i * span, t0 + (i + 1) * span, i % 2 == 1) for i in range(count)
        ]

    def at(self, t: float) -> Phase | None:
        for p in self.phases:
            if p.start <= t < p.end:
                return p
        return None

    def hostile_at(self, t: float) -> bool:
        p = self.at(t)
        return p is not None and p.hostile

    def windows(self) -> list[dict[str, Any]]:
        return [asdict(p) for p in self.phases]
