"""The engine host's pending and in-flight entries, indexed by request id, split request and batch."""

from __future__ import annotations

from collections.abc import Iterable

from engine.host.entry import Entry, Fanout
from engine.host.fair_queue import FairQueue


class LiveEntries:
    """Every entry the host holds, pending or in flight; the host's lock guards it. An entry
    leaves through :meth:`forget`, and a batch with no entry left leaves ``pending``'s
    bookkeeping with it."""

    def __init__(self, pending: FairQueue) -> None:
        self._pending = pending
        self._by_id: dict[str, Entry] = {}
        self._fanouts: dict[str, Fanout] = {}  # split n > 1 requests, by the caller's id
        self._groups: dict[str, set[str]] = {}

    def add(self, request_id: str, fanout: Fanout | None, entries: list[Entry]) -> None:
        """Hold a request's entries (its completions when ``fanout`` splits it) and queue
        them; ValueError if one of the ids is already pending or in flight."""
        taken = [e.request_id for e in entries if e.request_id in self._by_id]
        if request_id in self._by_id or request_id in self._fanouts or taken:
            raise ValueError(
                f"request id {(taken or [request_id])[0]!r} is already pending or in flight"
            )
        if fanout is not None:
            self._fanouts[request_id] = fanout
        for e in entries:
            self._by_id[e.request_id] = e
            if e.group is not None:
                self._groups.setdefault(e.group, set()).add(e.request_id)
            self._pending.push(e)

    def fanout(self, request_id: str) -> Fanout | None:
        return self._fanouts.get(request_id)

    def group_ids(self, group: str) -> list[str]:
        return list(self._groups.get(group, ()))

    def select(self, ids: Iterable[str] | None) -> list[Entry]:
        """The entries of ``ids`` still held (every entry when None)."""
        if ids is None:
            return list(self._by_id.values())
        return [self._by_id[i] for i in ids if i in self._by_id]

    def forget(self, entry: Entry) -> None:
        """Drop an entry from the indexes."""
        if self._by_id.pop(entry.request_id, None) is not None and entry.fanout is not None:
            entry.fanout.live -= 1
            if entry.fanout.live == 0:
                self._fanouts.pop(entry.fanout.request_id, None)
        if entry.group is not None:
            members = self._groups.get(entry.group)
            if members is not None:
                members.discard(entry.request_id)
                if not members:
                    del self._groups[entry.group]
                    self._pending.forget_group(entry.group)

    def clear(self) -> list[Entry]:
        """Drop everything, the pending queue included; returns the entries that were held."""
        entries = list(self._by_id.values())
        self._pending.clear()
        self._by_id.clear()
        self._fanouts.clear()
        self._groups.clear()
        return entries
