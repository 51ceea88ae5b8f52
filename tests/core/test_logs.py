"""Structured logs (core/observability/logs.py): ids follow the code that set them, and nothing
else."""

from __future__ import annotations

import io
import json
import logging
import threading

from core.observability.logs import bind_log_context, install, log_context


def _logger(fmt: str) -> tuple[logging.Logger, io.StringIO]:
    stream = io.StringIO()
    handler = logging.StreamHandler(stream)
    install([handler], fmt)
    logger = logging.getLogger(f"test.logs.{fmt}")
    logger.handlers[:] = [handler]
    logger.propagate = False
    logger.setLevel(logging.INFO)
    return logger, stream


def test_json_lines_carry_the_ids_of_their_context() -> None:
    logger, stream = _logger("json")
    with log_context(batch_id="batch_1", shard_id=None):
        bind_log_context(shard_id=7)
        with log_context(request_id="req-a"):
            logger.info("inside %s", "request")
        logger.warning("shard only")
    logger.info("outside")
    try:
        raise RuntimeError("boom")
    except RuntimeError:
        logger.exception("failed")
    records = [json.loads(line) for line in stream.getvalue().splitlines()]
    assert records[0]["message"] == "inside request"
    assert (records[0]["batch_id"], records[0]["shard_id"], records[0]["request_id"]) == (
        "batch_1",
        7,
        "req-a",
    )
    assert "request_id" not in records[1] and records[1]["shard_id"] == 7
    assert not {"batch_id", "shard_id", "request_id"} & set(records[2])
    assert records[3]["level"] == "ERROR" and "RuntimeError: boom" in records[3]["exc_info"]


def test_threads_keep_their_own_ids() -> None:
    logger, stream = _logger("json")
    barrier = threading.Barrier(2)

    def work(batch: str) -> None:
        with log_context(batch_id=batch):
            barrier.wait()
            logger.info("working")

    threads = [threading.Thread(target=work, args=(b,)) for b in ("batch_a", "batch_b")]
    for t in threads:
        t.start()
    for t in threads:
        t.join()
    seen = sorted(json.loads(line)["batch_id"] for line in stream.getvalue().splitlines())
    assert seen == ["batch_a", "batch_b"]


def test_text_format_is_left_alone() -> None:
    logger, stream = _logger("text")
    with log_context(batch_id="batch_1"):
        logger.info("plain")
    assert stream.getvalue() == "plain\n"
