"""cut_along_groups: a window's lines cut into shards along their prefix groups, under the
planner's limits (pure code)."""

from __future__ import annotations

from core.batches.sharding import cut_along_groups


def _items(groups: dict[tuple[int, ...], list[int]]) -> list[tuple[int, tuple[int, ...], int]]:
    return [(line, path, 10) for path, lines in sorted(groups.items()) for line in lines]


def test_small_groups_join_whole_and_a_large_one_gets_shards_of_its_own() -> None:
    items = _items({(1,): [1, 4], (2,): [2, 5], (3,): [3, 6, 9, 12, 15, 18, 21]})
    assert cut_along_groups(items, 10_000, 4) == [[1, 4, 2, 5], [3, 6, 9, 12], [15, 18, 21]]


def test_a_group_that_does_not_fit_the_open_shard_starts_one() -> None:
    items = _items({(1,): [1, 2, 3], (2,): [4, 5]})
    assert cut_along_groups(items, 10_000, 4) == [[1, 2, 3], [4, 5]]


def test_a_large_group_is_cut_along_its_subgroups_and_keeps_to_itself() -> None:
    items = _items({(1, 7): [1, 2], (1, 8): [3, 4, 5], (1,): [6], (2,): [9]})
    cut = cut_along_groups(items, 10_000, 3)
    assert cut == [[6, 1, 2], [3, 4, 5], [9]]
    assert sorted(n for shard in cut for n in shard) == [1, 2, 3, 4, 5, 6, 9]


def test_token_limits_cut_too_and_no_shard_is_empty() -> None:
    items = [(n, (1,), 40) for n in range(1, 6)] + [(9, (), 100)]
    assert cut_along_groups(items, 100, 10) == [[1, 2], [3, 4], [5], [9]]
    assert cut_along_groups([], 100, 10) == []
