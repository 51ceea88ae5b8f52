"""The prefix plan (core.batches.plan), pure: the groups it finds, the order inside a shard,
the tokens it predicts shareable, and its bounded memory."""

from __future__ import annotations

import random

from core.batches.plan import PlanItem, PrefixIndex, plan_order


def _shared_blocks(ids: list[int], earlier: list[list[int]], block: int) -> int:
    """The full blocks of ``ids``' longest prefix shared with an earlier line (brute force)."""
    best = 0
    for other in earlier:
        n = 0
        while n < min(len(ids), len(other)) and ids[n] == other[n]:
            n += 1
        best = max(best, n // block)
    return best


def _file(seed: int, templates: int, lines: int) -> tuple[list[list[int]], list[int]]:
    rng = random.Random(seed)
    heads = [[rng.randrange(1000) for _ in range(rng.randrange(40, 90))] for _ in range(templates)]
    prompts, which = [], []
    for i in range(lines):
        t = i % templates
        prompts.append(heads[t] + [rng.randrange(1000) for _ in range(rng.randrange(3, 30))])
        which.append(t)
    return prompts, which


def test_shareable_tokens_are_the_block_aligned_prefixes_earlier_lines_hold() -> None:
    prompts, _ = _file(1, 5, 60)
    index = PrefixIndex(max_nodes=10_000, block=8)
    for ids in prompts:
        index.add(ids)
    expected = sum(8 * _shared_blocks(p, prompts[:i], 8) for i, p in enumerate(prompts))
    assert index.shareable_tokens == expected > 0
    assert index.prompt_tokens == sum(map(len, prompts))


def test_a_shard_runs_its_groups_together_longest_output_first() -> None:
    prompts, which = _file(2, 4, 40)
    index = PrefixIndex(max_nodes=10_000, block=8)
    ranks = [index.add(ids) for ids in prompts]
    decode = [(7 * i) % 11 for i in range(40)]
    shard = range(10, 34)  # a shard in the middle of the file: lines 10..33
    order = plan_order(PlanItem(i, index.path(ranks[i]), decode[i]) for i in shard)
    assert sorted(order) == list(shard)
    groups = [which[i] for i in order]
    # Each template's lines in one run, the templates in the order the file first showed them.
    assert groups == sorted(groups)
    for t in set(groups):
        members = [i for i in order if which[i] == t]
        assert [decode[i] for i in members] == sorted((decode[i] for i in members), reverse=True)
        ties = [i for i in members if decode[i] == decode[members[0]]]
        assert ties == sorted(ties)


def test_lines_that_share_nothing_keep_file_order_after_the_groups() -> None:
    index = PrefixIndex(max_nodes=100, block=4)
    a = index.add([1, 2, 3, 4, 5])
    lone = index.add([9, 9, 9, 9, 9])
    b = index.add([1, 2, 3, 4, 6])
    short = index.add([1, 2])  # no full block: nothing to share
    items = [
        PlanItem(1, index.path(a), 1),
        PlanItem(2, index.path(lone), 50),
        PlanItem(3, index.path(b), 9),
        PlanItem(4, index.path(short), 99),
    ]
    assert plan_order(items) == [3, 1, 2, 4]


def test_the_index_holds_at_most_its_nodes_and_degrades_to_file_order() -> None:
    prompts, _ = _file(3, 6, 80)
    capped = PrefixIndex(max_nodes=12, block=8)
    ranks = [capped.add(ids) for ids in prompts]
    assert capped.nodes == 12 and capped.full
    assert len(capped._count) == 12  # its memory: one counter a node
    # What it holds still groups the prefixes it has room for; beyond, lines share nothing.
    assert any(capped.path(r) for r in ranks) and not all(capped.path(r) for r in ranks)

    none = PrefixIndex(max_nodes=0, block=8)
    ranks = [none.add(ids) for ids in prompts]
    assert none.nodes == 0 and none.full and none.shareable_tokens == 0
    order = plan_order(PlanItem(i, none.path(r), 100 - i) for i, r in enumerate(ranks))
    assert order == list(range(len(prompts)))  # file order
