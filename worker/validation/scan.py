"""Scan an input file once as a whole: validate every line, count its tokens, plan its shards.

What an estimate of a file reports; a batch's validation streams shards instead
(:mod:`worker.validation.task`).
"""

from __future__ import annotations

import time
from dataclasses import dataclass

from core.batches.plan import PrefixIndex
from core.batches.sharding import ShardPlanner
from core.batchfile.reader import ValidationReport, validate_file
from core.batchfile.request import BatchRequest
from core.llms import specs
from core.settings import get_settings
from worker.infra import storage
from worker.validation.token_count import TokenCounter


@dataclass(slots=True)
class _Scan:
    """A validated input file: the report, the shards planned, the prompt tokens counted and
    those the prefix plan finds shareable (core.batches.plan)."""

    report: ValidationReport
    planner: ShardPlanner
    prompt_tokens: int
    shareable_tokens: int = 0


class CallerGone(TimeoutError):
    """The caller of a scan stopped waiting for it: the rest of the file is not read."""


def scan_input(key: str, endpoint: str, deadline: float | None = None) -> _Scan:
    """Stream the input file once as a whole: validate every line, count its tokens, plan the
    shards (what an estimate of the file reports; a batch's validation streams shards instead,
    :mod:`worker.validation.task`). Past ``deadline`` (unix seconds: when its caller stops
    waiting) it stops with :class:`CallerGone`: nobody reads the rest of a file for nothing."""
    settings = get_settings()
    served = [m for m, spec in settings.models.items() if specs.serves(spec, endpoint)]
    planner = ShardPlanner(settings.shard_max_tokens, settings.shard_max_requests)
    count = TokenCounter(served)
    index = PrefixIndex(settings.prefix_plan_max_nodes) if settings.prefix_plan else None

    def on_request(req: BatchRequest) -> None:
        if deadline is not None and req.line % 256 == 0 and time.time() > deadline:
            raise CallerGone(f"the caller stopped waiting at line {req.line}")
        planner.add(req.line, req.offset, req.length, count(req))
        if index is not None and count.last_plan_ids is not None:
            index.add(count.last_plan_ids)

    with storage().reader(key) as stream:
        report = validate_file(
            stream,
            endpoint=endpoint,
            served_models=served,
            max_requests=settings.max_requests_per_batch,
            max_line_bytes=settings.max_line_bytes,
            max_errors=settings.max_errors_reported,
            on_request=on_request,
            forwarded=specs.forwarded_models(settings.models),
            engine_models=specs.engine_models(settings.models),
        )
    shareable = index.shareable_tokens if index is not None else 0
    return _Scan(report, planner, count.prompt_tokens, shareable)
