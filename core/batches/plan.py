"""The prefix plan of a batch: which of its lines share a prompt prefix, and the order a shard
runs its lines in so that they reuse the engine's prefix cache.

A batch is a whole file, known before its first token. Validation feeds every request's
prompt ids, in file order, to one :class:`PrefixIndex`: a hash chain over block-aligned
prefixes (``block`` ids each, the engine's KV block), one node per distinct prefix, counted by
the lines that hold it. Its memory is bounded by ``max_nodes``: once full it adds no node (the
prefixes it knows are still counted and matched), so a line whose prefix came too late keeps
its place in file order; at 0 nodes the plan is file order.

For each line the index answers two things:

* its **shareable tokens**: the ids of its longest prefix that an earlier line already holds
  (what a prefix cache large enough could serve it; their sum is the batch's
  ``predicted_shareable_tokens``);
* its **group path**: the first-seen ranks of the prefix nodes it shares with any other line
  seen so far. Sorted on that path, lines walk the prefix tree depth first: every line of a
  few-shot block together, the blocks in the order the file first showed them (so shards that
  run at once reach the same block at about the same time).

:func:`plan_order` orders one shard's lines: by group path, then the longest expected output
(``max_tokens``) first, then file order. Pure code; the policy is ``docs/validation.md``."""

from __future__ import annotations

from array import array
from collections.abc import Iterable, Sequence
from dataclasses import dataclass

__all__ = ["BLOCK_TOKENS", "PlanItem", "PrefixIndex", "plan_order"]

BLOCK_TOKENS = 16  # the engine's KV block size (engine.core.config)
_SEED = 0x9E3779B97F4A7C15
_MASK = (1 << 64) - 1


def _chain(ids: Sequence[int], block: int) -> Iterable[int]:
    """The hash of each full block-aligned prefix of ``ids``, shortest first."""
    h = _SEED
    for start in range(0, len(ids) - len(ids) % block, block):
        h = hash((h, *ids[start : start + block])) & _MASK
        yield h


@dataclass(frozen=True, slots=True)
class PlanItem:
    """One request line as the plan sees it."""

    line: int
    path: tuple[int, ...]  # the ranks of the shared prefix nodes, root first
    decode: int  # the output tokens it may produce (max_tokens)


class PrefixIndex:
    """Block-aligned prefixes of a file's prompts, counted by line, at most ``max_nodes``."""

    def __init__(self, max_nodes: int, block: int = BLOCK_TOKENS):
        if block < 1:
            raise ValueError("block must be >= 1")
        self.block = block
        self.max_nodes = max(0, int(max_nodes))
        self._rank: dict[int, int] = {}  # prefix hash -> its node's rank (first seen first)
        self._count = array("I")  # lines holding each node, by rank
        self.full = False  # a prefix was left out for want of room
        self.lines = 0
        self.prompt_tokens = 0
        self.shareable_tokens = 0

    @property
    def nodes(self) -> int:
        return len(self._rank)

    def add(self, ids: Sequence[int]) -> list[int]:
        """Count the line whose prompt is ``ids``; return the ranks of its prefix nodes that the
        index holds, root first (the ones beyond its room are left out, and every deeper one)."""
        self.lines += 1
        self.prompt_tokens += len(ids)
        ranks: list[int] = []
        shared = 0
        for h in _chain(ids, self.block):
            rank = self._rank.get(h)
            if rank is None:
                if len(self._rank) >= self.max_nodes:
                    self.full = True
                    break
                rank = len(self._count)
                self._rank[h] = rank
                self._count.append(0)
            elif len(ranks) == shared:
                shared += 1  # an earlier line holds this prefix too
            self._count[rank] += 1
            ranks.append(rank)
        self.shareable_tokens += shared * self.block
        return ranks

    def path(self, ranks: Sequence[int]) -> tuple[int, ...]:
        """The part of a line's ``ranks`` shared with another line seen so far."""
        n = 0
        for rank in ranks:
            if self._count[rank] < 2:
                break
            n += 1
        return tuple(ranks[:n])


def plan_order(items: Iterable[PlanItem]) -> list[int]:
    """The lines of one shard in the order to run them: lines sharing a prefix together (depth
    first over the prefix tree, in first-seen order), inside a group the longest expected
    output first, then file order; lines that share nothing come last, in file order."""
    return [
        item.line
        for item in sorted(
            items, key=lambda i: (not i.path, i.path, -i.decode if i.path else 0, i.line)
        )
    ]
