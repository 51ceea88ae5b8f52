"""The host of a served model in this process, as the worker's shard code uses it.

:class:`Host` is what every host answers, structurally: the engine host
(``engine.host.host.EngineHost``), the embedding host
(``engine.embedding.embedding_host.EmbeddingHost``) and an upstream's dispatcher
(:class:`worker.upstream.dispatcher.Dispatcher`). How a request is submitted differs by host: each
handler of ``worker.shards.handlers`` holds its own kind."""

from __future__ import annotations

from typing import Any, Protocol


class Host(Protocol):
    @property
    def tokenizer(self) -> Any:
        """The model's tokenizer; None for an upstream, which tokenizes its own prompts."""
        ...

    def abort_group(self, group: str) -> object:
        """Drop the pending requests of ``group`` (a batch) and stop those in flight: each
        resolves as aborted. What it returns is not read."""
        ...

    def shutdown(
        self, wait: bool = True, *, abort_pending: bool = False, timeout: float | None = None
    ) -> None:
        """Stop taking work; ``abort_pending`` aborts what is queued instead of finishing it."""
        ...
