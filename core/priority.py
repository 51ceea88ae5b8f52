"""A batch's priority, defined once: its three names, their order, and the number the engine
and the upstream dispatcher are given.

Every place that reads a priority goes through :class:`Priority`: the API's schemas (through
:data:`PriorityName`, the same names as a ``Literal`` for pydantic and OpenAPI), API keys'
``max_priority``, the shard release window, the ETA projections and the shard handlers that
hand work to the engine host or an upstream fleet.

The engine is a leaf and cannot import this module, so it keeps its own convention for the
number: lower runs first, 0 is ``normal``, below 0 is urgent (``engine.host.order``).
:attr:`Priority.engine` follows it, and ``tests/test_structure.py`` checks that the two agree.
"""

from __future__ import annotations

from enum import StrEnum
from typing import Literal, cast

#: The names as the API accepts them (a ``Literal`` keeps the OpenAPI schema an inline enum);
#: the same names, in the same order, as :class:`Priority`.
PriorityName = Literal["high", "normal", "low"]


class Priority(StrEnum):
    """Most urgent first: ``high`` before ``normal`` before ``low``."""

    HIGH = "high"
    NORMAL = "normal"
    LOW = "low"

    @property
    def rank(self) -> int:
        """0 for ``high``, counting up towards ``low``: what the release window and the ETA
        projections compare (lower runs first)."""
        return _RANKS[self]

    @property
    def engine(self) -> int:
        """The engine's priority: lower runs first, ``normal`` is 0, ``high`` (urgent) is
        negative, ``low`` positive."""
        return _RANKS[self] - _RANKS[Priority.NORMAL]

    def allows(self, requested: Priority) -> bool:
        """Whether a key whose highest priority is this one may ask for ``requested``."""
        return requested.rank >= self.rank

    @classmethod
    def parse(cls, value: str | None) -> Priority:
        """``value`` as a priority: ``normal`` for None and for anything that is not one of the
        three names (a stored row is read, never refused)."""
        try:
            return cls(value)
        except ValueError:
            return cls.NORMAL


_RANKS = {priority: rank for rank, priority in enumerate(Priority)}


def priority_name(value: str | None) -> PriorityName:
    """:meth:`Priority.parse`, as the API's ``Literal`` name."""
    return cast(PriorityName, Priority.parse(value).value)
