"""Identifiers: OpenAI's shapes, unique within a process and across forked workers."""

from __future__ import annotations

import os
import re

from core.batches import ids


def test_ids_have_openai_shapes_and_do_not_repeat() -> None:
    shapes = {
        ids.file_id: r"file-[0-9a-f]{24}",
        ids.batch_id: r"batch_[0-9a-f]{24}",
        ids.batch_request_id: r"batch_req_[0-9a-f]{24}",
        ids.chat_completion_id: r"chatcmpl-[0-9a-f]{24}",
        ids.completion_id: r"cmpl-[0-9a-f]{24}",
        ids.response_id: r"resp_[0-9a-f]{48}",
        ids.message_id: r"msg_[0-9a-f]{48}",
        ids.request_id: r"req_[0-9a-f]{32}",
    }
    for make, pattern in shapes.items():
        made = [make() for _ in range(2000)]
        assert all(re.fullmatch(pattern, i) for i in made), make.__name__
        assert len(set(made)) == len(made), make.__name__


def test_a_forked_worker_draws_other_line_ids_than_its_parent() -> None:
    read, write = os.pipe()
    pid = os.fork()
    if pid == 0:  # the child: its next ids, to the parent
        os.close(read)
        os.write(write, " ".join(ids.batch_request_id() for _ in range(50)).encode())
        os._exit(0)
    os.close(write)
    mine = {ids.batch_request_id() for _ in range(50)}
    with os.fdopen(read) as pipe:
        child = set(pipe.read().split())
    os.waitpid(pid, 0)
    assert len(child) == 50 and not mine & child
