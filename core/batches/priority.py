"""A batch's priority, defined once: its three names, their order, and the number the engine
and the upstream dispatcher are given.

Every reader of a priority goes through :class:`Priority` (the API's schemas through
:data:`PriorityName`). The engine cannot import this module, so it keeps its own convention
(lower runs first, 0 is ``normal``, below 0 urgent: ``engine.host.order``);
:attr:`Priority.engine` follows it, and ``tests/test_structure.py`` checks that they agree."""

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
            return cls(value) if value is not None else cls.NORMAL
        except ValueError:
            return cls.NORMAL


_RANKS = {priority: rank for rank, priority in enumerate(Priority)}


def priority_name(value: str | None) -> PriorityName:
    """:meth:`Priority.parse`, as the API's ``Literal`` name."""
    return cast(PriorityName, Priority.parse(value).value)
