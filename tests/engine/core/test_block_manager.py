"""KV block pool: ref counts, prefix-cache hash chain, LRU eviction with tails first."""

from __future__ import annotations

import hashlib
import struct

import pytest

from engine.core import sequence as sequence_module
from engine.core.block_manager import BlockManager
from engine.core.outputs import RequestMetrics
from engine.core.sampling_params import SamplingParams
from engine.core.sequence import Request, Sequence

BS = 4


def seq(tokens: list[int], cache_salt: str | None = None) -> Sequence:
    request = Request(
        "r", list(tokens), SamplingParams(), RequestMetrics(arrival_time=0.0), cache_salt=cache_salt
    )
    return Sequence(request, 0, list(tokens), len(tokens) + 16, None)


def admit(bm: BlockManager, s: Sequence) -> int:
    """Allocate the whole sequence, mark it computed; return the cached-token count."""
    cached = bm.match_prefix(s)
    assert bm.allocate(s, cached, len(s))
    s.num_computed_tokens = len(s)
    bm.mark_computed(s)
    return len(cached) * BS


def test_allocate_and_free_returns_every_block() -> None:
    bm = BlockManager(8, BS)
    a, b = seq(list(range(10))), seq(list(range(100, 107)))
    admit(bm, a)
    admit(bm, b)
    assert len(a.block_table) == 3 and len(b.block_table) == 2
    assert bm.num_free_blocks == 3
    bm.free_seq(a)
    bm.free_seq(b)
    assert bm.num_free_blocks == 8
    assert all(c == 0 for c in bm.ref_count)


def test_allocation_fails_cleanly_when_pool_is_short() -> None:
    bm = BlockManager(2, BS)
    s = seq(list(range(9)))  # 3 blocks
    assert not bm.allocate(s, [], len(s))
    assert bm.num_free_blocks == 2 and s.block_table == []
    small = seq([1, 2, 3])
    assert bm.allocate(small, [], 3)
    assert not bm.grow(small, 9)
    assert bm.grow(small, 8)
    assert len(small.block_table) == 2


def test_hash_chain_hits_and_misses() -> None:
    bm = BlockManager(16, BS)
    a = seq(list(range(12)))
    admit(bm, a)
    # Same first two blocks, different third: two blocks hit.
    b = seq(list(range(8)) + [99, 98, 97, 96, 95])
    assert admit(bm, b) == 8
    assert b.block_table[:2] == a.block_table[:2]
    assert bm.ref_count[a.block_table[0]] == 2
    # Same tokens in block 2 but a different parent: the chain makes it a miss.
    c = seq([7, 7, 7, 7] + list(range(4, 12)))
    assert admit(bm, c) == 0
    # The hit is capped so the last token is computed: 12 tokens, 3 full blocks -> 2 hit.
    d = seq(list(range(12)))
    assert admit(bm, d) == 8


def test_shared_blocks_stay_until_last_user_frees() -> None:
    bm = BlockManager(16, BS)
    a, b = seq(list(range(9))), seq(list(range(9)))
    admit(bm, a)
    admit(bm, b)
    shared = a.block_table[:2]
    bm.free_seq(a)
    assert all(bm.ref_count[x] == 1 for x in shared)
    assert all(x not in bm.free for x in shared)
    bm.free_seq(b)
    assert all(bm.ref_count[x] == 0 for x in shared)


def test_freed_cached_blocks_are_reused_then_evicted_lru_tail_first() -> None:
    bm = BlockManager(4, BS)
    a = seq(list(range(17)))  # 4 full blocks + 1 token -> needs 5 blocks: too many
    assert not bm.allocate(a, [], len(a))
    a = seq(list(range(16)))  # 4 blocks
    admit(bm, a)
    blocks = list(a.block_table)
    bm.free_seq(a)
    # Freed tail first: the LRU order is block 3, 2, 1, 0 of the sequence.
    assert list(bm.free) == blocks[::-1]
    # The prefix is still cached: a new sequence with the same start hits 3 blocks (capped).
    b = seq(list(range(16)))
    assert admit(bm, b) == 12
    bm.free_seq(b)
    # A fresh sequence needing one block evicts the least recently freed one: the tail.
    tail_hash = bm.block_hash[blocks[3]]
    c = seq([500, 501])
    admit(bm, c)
    assert c.block_table == [blocks[3]]
    assert tail_hash not in bm.hash_to_block
    assert bm.block_hash[blocks[0]] is not None  # the head survives
    d = seq(list(range(8)) + [1, 2])
    assert admit(bm, d) == 8


def test_prefix_caching_off_never_hits() -> None:
    bm = BlockManager(8, BS, enable_prefix_caching=False)
    admit(bm, seq(list(range(12))))
    assert admit(bm, seq(list(range(12)))) == 0


def test_block_keys_are_sha256_of_the_parent_key_and_the_tokens() -> None:
    s = seq(list(range(9)))
    first, second = s.hashes_for(2, BS)
    assert first == hashlib.sha256(struct.pack("<4I", 0, 1, 2, 3)).digest()
    assert second == hashlib.sha256(first + struct.pack("<4I", 4, 5, 6, 7)).digest()
    # The salt changes the first key, and through the chain every later one.
    salted = seq(list(range(9)), cache_salt="tenant-a").hashes_for(2, BS)
    assert salted[0] != first and salted[1] != second


def test_cache_salt_scopes_the_prefix_cache() -> None:
    bm = BlockManager(32, BS)
    tokens = list(range(13))  # 3 full blocks; a hit is capped at 12 tokens
    assert admit(bm, seq(tokens, cache_salt="tenant-a")) == 0
    assert admit(bm, seq(tokens, cache_salt="tenant-b")) == 0
    assert admit(bm, seq(tokens)) == 0  # no salt is a scope of its own
    assert admit(bm, seq(tokens, cache_salt="tenant-a")) == 12
    assert admit(bm, seq(tokens, cache_salt="tenant-b")) == 12
    assert admit(bm, seq(tokens)) == 12


@pytest.fixture
def colliding_digest(monkeypatch: pytest.MonkeyPatch) -> None:
    """Every block of every prompt gets the same key: the worst case of a broken digest."""
    monkeypatch.setattr(sequence_module, "block_digest", lambda parent, token_ids: b"collision")


@pytest.mark.usefixtures("colliding_digest")
def test_a_digest_collision_never_serves_another_salts_block() -> None:
    bm = BlockManager(32, BS)
    tokens = list(range(9))
    a = seq(tokens, cache_salt="tenant-a")
    admit(bm, a)
    b = seq(tokens, cache_salt="tenant-b")
    assert bm.match_prefix(b) == []
    assert admit(bm, b) == 0
    assert not set(b.block_table) & set(a.block_table)
    # The same salt still hits its first block (the only one registered: all keys are equal).
    assert admit(bm, seq(tokens, cache_salt="tenant-a")) == BS


@pytest.mark.usefixtures("colliding_digest")
def test_a_digest_collision_never_serves_other_tokens() -> None:
    bm = BlockManager(32, BS)
    admit(bm, seq(list(range(9)), cache_salt="tenant-a"))
    other = seq([50, 51, 52, 53, 54, 55, 56, 57, 58], cache_salt="tenant-a")
    assert bm.match_prefix(other) == []
