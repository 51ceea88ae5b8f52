"""A fixed pool of KV blocks with ref counts and prefix caching.

A full block is keyed by a chain digest (SHA-256 of its parent's key and its token ids). A
computed block is registered under (its request's cache salt, its key); freed by its last user
it stays cached in an LRU free list until a fresh block is needed, and sequences free tail
first. A hit needs the same salt and the same token ids, not only the digest: requests with
different salts (the service salts each tenant's) never share a block.
"""

from __future__ import annotations

from collections import OrderedDict

from engine.core.sequence import Sequence

CacheKey = tuple[str | None, bytes]  # (cache salt, block key)


class BlockManager:
    def __init__(
        self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True
    ) -> None:
        self.num_blocks = num_blocks
        self.block_size = block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref_count = [0] * num_blocks
        self.block_hash: list[CacheKey | None] = [None] * num_blocks
        self.block_tokens: list[list[int] | None] = [None] * num_blocks  # of a cached block
        self.hash_to_block: dict[CacheKey, int] = {}
        # Free blocks, least recently freed first; cached ones keep their hash until reused.
        self.free: OrderedDict[int, None] = OrderedDict((b, None) for b in range(num_blocks))

    @property
    def num_free_blocks(self) -> int:
        return len(self.free)

    @property
    def num_used_blocks(self) -> int:
        return self.num_blocks - len(self.free)

    def blocks_needed(self, num_tokens: int) -> int:
        return -(-num_tokens // self.block_size)

    # -- prefix cache -------------------------------------------------------------------------

    def match_prefix(self, seq: Sequence) -> list[int]:
        """Cached blocks that hold a prefix of ``seq``; at most ``len(seq) - 1`` tokens so the
        last token is always computed and yields logits."""
        if not self.enable_prefix_caching:
            return []
        max_blocks = (len(seq) - 1) // self.block_size
        if max_blocks == 0:
            return []
        matched = []
        salt, bs, tokens = seq.cache_salt, self.block_size, seq.token_ids
        for i, h in enumerate(seq.hashes_for(max_blocks, bs)):
            block = self.hash_to_block.get((salt, h))
            if block is None or self.block_tokens[block] != tokens[i * bs : (i + 1) * bs]:
                break
            matched.append(block)
        return matched

    def num_new_blocks_for(self, cached: list[int], num_tokens: int) -> int:
        """Blocks that must come off the free list to hold ``num_tokens`` given ``cached``
        (cached blocks that are free also leave the free list)."""
        reused_free = sum(1 for b in cached if self.ref_count[b] == 0)
        return self.blocks_needed(num_tokens) - len(cached) + reused_free

    # -- allocation ---------------------------------------------------------------------------

    def allocate(self, seq: Sequence, cached: list[int], num_tokens: int) -> bool:
        """Give a waiting ``seq`` the ``cached`` prefix blocks and fresh ones up to ``num_tokens``.
        Returns False (and changes nothing) when the pool is short."""
        if self.num_new_blocks_for(cached, num_tokens) > len(self.free):
            return False
        for b in cached:
            if self.ref_count[b] == 0:
                del self.free[b]
            self.ref_count[b] += 1
        seq.block_table = list(cached)
        seq.num_hashed_blocks = len(cached)
        return self._grow(seq, num_tokens)

    def grow(self, seq: Sequence, num_tokens: int) -> bool:
        """Make room for ``num_tokens`` tokens of a running ``seq``; False when the pool is short."""
        if self.blocks_needed(num_tokens) - len(seq.block_table) > len(self.free):
            return False
        return self._grow(seq, num_tokens)

    def _grow(self, seq: Sequence, num_tokens: int) -> bool:
        table = seq.block_table
        for _ in range(self.blocks_needed(num_tokens) - len(table)):
            table.append(self._take_free())
        return True

    def _take_free(self) -> int:
        block, _ = self.free.popitem(last=False)
        h = self.block_hash[block]
        if h is not None:  # evict it from the prefix cache
            if self.hash_to_block.get(h) == block:
                del self.hash_to_block[h]
            self.block_hash[block] = None
            self.block_tokens[block] = None
        self.ref_count[block] = 1
        return block

    def share(self, blocks: list[int]) -> None:
        """Another sequence takes a reference to ``blocks`` (a fork)."""
        for b in blocks:
            self.ref_count[b] += 1

    def free_seq(self, seq: Sequence) -> None:
        """Release ``seq``'s blocks, tail first, so the tail is evicted before the shared head."""
        for b in reversed(seq.block_table):
            self.ref_count[b] -= 1
            if self.ref_count[b] == 0:
                self.free[b] = None
        seq.block_table = []
        seq.num_hashed_blocks = 0

    def mark_computed(self, seq: Sequence) -> None:
        """Register the full blocks of ``seq`` whose K/V are now computed in the prefix cache."""
        if not self.enable_prefix_caching:
            return
        full = seq.num_computed_tokens // self.block_size
        if full <= seq.num_hashed_blocks:
            return
        bs, salt = self.block_size, seq.cache_salt
        hashes = seq.hashes_for(full, bs)
        for i in range(seq.num_hashed_blocks, full):
            block = seq.block_table[i]
            key = (salt, hashes[i])
            if self.block_hash[block] is None and key not in self.hash_to_block:
                self.block_hash[block] = key
                self.block_tokens[block] = seq.token_ids[i * bs : (i + 1) * bs]
                self.hash_to_block[key] = block
        seq.num_hashed_blocks = full
