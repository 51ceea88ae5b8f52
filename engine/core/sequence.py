"""A sequence (one completion being generated) and the request that owns one or more of them."""

from __future__ import annotations

import enum
import hashlib
import itertools
from array import array
from dataclasses import dataclass, field
from typing import Any

import torch

from engine.core.outputs import RequestMetrics, TokenLogprob
from engine.core.sampling_params import SamplingParams


class Status(enum.Enum):
    WAITING = "waiting"
    RUNNING = "running"
    FINISHED = "finished"
    SUSPENDED = "suspended"  # taken out of the engine by its caller, to be resumed


@dataclass(slots=True, eq=False)
class Request:
    """A user request: a prompt, its sampling parameters and its ``n`` sequences.

    ``cache_salt`` scopes the prefix cache: requests share cached KV blocks only with requests
    of the same salt (None is a scope of its own). ``lora``: the adapter its rows apply
    (None: the base model); it scopes the prefix cache too, as the KV of a prompt differs by
    adapter.
    """

    request_id: str
    prompt_token_ids: list[int]
    params: SamplingParams
    metrics: RequestMetrics
    seqs: list[Sequence] = field(default_factory=list)
    num_unfinished: int = 0
    cache_salt: str | None = None
    admitted: bool = False  # its prompt was counted in the engine's prompt/cache totals
    lora: str | None = None


def block_digest(parent: bytes, token_ids: list[int]) -> bytes:
    """The key of one full KV block: SHA-256 over the parent block's key and the block's token
    ids (4 bytes each), so equal keys mean equal prefixes and a key cannot be crafted to
    collide with another prompt's."""
    return hashlib.sha256(parent + array("I", token_ids).tobytes()).digest()


def salt_digest(cache_salt: str | None, lora: str | None = None) -> bytes:
    """The parent key of a sequence's first block: empty without a salt or an adapter, else a
    digest of them (a different length from any block key, so the two never meet). The
    adapter's name is folded in: blocks computed under one adapter (or the base) are never
    read under another."""
    if cache_salt is None and lora is None:
        return b""
    key = b"" if cache_salt is None else b"cache_salt:" + cache_salt.encode()
    if lora is not None:
        key += b"\0lora:" + lora.encode()
    return hashlib.sha256(key).digest()[:16]


_ids = itertools.count()


class Sequence:
    """Token ids, how many of them have KV in the cache, the block table and sampling state.

    ``num_computed_tokens`` counts tokens whose K/V are in the cache; the target is always
    ``len(token_ids)``: the scheduler hands out tokens until they are all computed, and the step
    that computes the last one samples the next token.
    """

    __slots__ = (
        "seq_id",
        "request",
        "index",
        "params",
        "token_ids",
        "num_prompt_tokens",
        "num_computed_tokens",
        "block_table",
        "block_hashes",
        "num_hashed_blocks",
        "status",
        "max_len",
        "generator",
        "logprobs",
        "finish_reason",
        "stop_reason",
        "text",
        "detok_prefix",
        "detok_read",
        "needs_fork",
        "expected_work",
        "bucket",
        "epoch",
        "priority",
        "matcher",
    )

    def __init__(
        self,
        request: Request,
        index: int,
        token_ids: list[int],
        max_len: int,
        generator: torch.Generator | None,
    ) -> None:
        self.seq_id = next(_ids)
        self.request = request
        self.index = index
        self.params = request.params
        self.token_ids = token_ids
        self.num_prompt_tokens = len(request.prompt_token_ids)
        self.num_computed_tokens = 0
        self.block_table: list[int] = []
        self.block_hashes: list[bytes] = []  # key chain over this sequence's full blocks
        self.num_hashed_blocks = 0  # leading blocks registered in the prefix cache
        self.status = Status.WAITING
        self.max_len = max_len  # prompt + max_tokens, clamped to the model's length
        self.generator = generator
        self.logprobs: list[TokenLogprob] | None = [] if self.params.logprobs else None
        self.finish_reason: str | None = None
        self.stop_reason: str | int | None = None
        self.text = ""
        self.detok_prefix = 0
        self.detok_read = 0
        self.needs_fork = self.params.n > 1 and index == 0
        self.expected_work = max_len
        self.bucket: object = None
        self.epoch = 0  # bumped whenever the sequence enters or leaves the waiting queue
        self.priority = 0  # admission order: lower first
        self.matcher: Any = None  # the grammar matcher of a structured-output request

    def __len__(self) -> int:
        return len(self.token_ids)

    @property
    def num_output_tokens(self) -> int:
        return len(self.token_ids) - self.num_prompt_tokens

    @property
    def output_token_ids(self) -> list[int]:
        return self.token_ids[self.num_prompt_tokens :]

    @property
    def is_finished(self) -> bool:
        return self.status is Status.FINISHED

    @property
    def cache_salt(self) -> str | None:
        return self.request.cache_salt

    def hashes_for(self, num_blocks: int, block_size: int) -> list[bytes]:
        """The key chain of the first ``num_blocks`` full blocks, extended on demand; the
        request's cache salt is folded into the first block's key."""
        hashes = self.block_hashes
        tokens = self.token_ids
        while len(hashes) < num_blocks:
            i = len(hashes)
            request = self.request
            parent = hashes[-1] if hashes else salt_digest(request.cache_salt, request.lora)
            hashes.append(block_digest(parent, tokens[i * block_size : (i + 1) * block_size]))
        return hashes
