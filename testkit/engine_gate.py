"""A gate in an engine, for tests that need work to be still running when they act (cancel,
expire, kill, read partial results), however fast the machine: the work is held on purpose,
never sized to take long enough. Test-only: nothing in the service refers to this module.

A request whose prompt contains ``GATE-<name>`` holds its engine while the gate ``<name>`` is
closed: each ``step()`` then computes nothing (it waits a moment and reports only the requests
aborted since the last step), so every request in that engine stays where it is. The gate
opens when the test opens it, or when the request leaves the engine (a cancel or an expiry
aborts it; a suspension takes it out), so a batch that is cancelled or expires ends as usual.
Put the marked line last, so the lines before it run (and finish) before the engine is held.

- In this process: :func:`install` on an engine, with a callable that says whether a gate is
  closed (a :class:`threading.Event` not set, say).
- In a real model worker: ``celery worker -I testkit.engine_gate`` (``MODEL_WORKER_GATE``)
  with ``BATCHD_TEST_GATE_DIR`` set: every engine that process makes is gated, a gate being
  closed while the file ``$BATCHD_TEST_GATE_DIR/<name>`` exists. :class:`FileGate` is the test's
  side of it. The first hold of each gate logs ``engine gate <name> holding``.

A worker can also be given a fixed amount of work: with ``BATCHD_TEST_GATE_AFTER=<n>`` its
engine holds for good once ``n`` requests have finished (until the process is killed), the
requests then in flight staying in flight. A test that kills workers one after another gives
each this cap, so the job outlasts the kills by construction, not by its size. It logs
``engine gate after <n> holding``, and ``engine gate after <n> holding requests in flight``
once a request is held (its shard cannot end before the kill).
"""

from __future__ import annotations

import logging
import os
import re
import time
from collections.abc import Callable, Iterator
from contextlib import contextmanager
from pathlib import Path
from typing import Any

logger = logging.getLogger("engine_gate")

ENV = "BATCHD_TEST_GATE_DIR"
AFTER_ENV = "BATCHD_TEST_GATE_AFTER"
#: The model worker's extra options that load the gate (``celery worker -I``).
MODEL_WORKER_GATE = ["-I", "testkit.engine_gate"]
_MARKER = re.compile(r"GATE-([A-Za-z0-9_]+)")
HOLD_WAIT_S = 0.02


def marker(name: str) -> str:
    """The text a prompt carries to be held by gate ``name``."""
    if not re.fullmatch(r"[A-Za-z0-9_]+", name):
        raise ValueError(f"a gate's name is letters, digits and underscores, not {name!r}")
    return f"GATE-{name}"


def install(engine: Any, closed: Callable[[str], bool], *, after: int | None = None) -> None:
    """Gate ``engine`` (an :class:`engine.Engine`): its ``step()`` holds while a request whose
    prompt names a gate is in the engine and ``closed(name)`` says that gate is closed, and for
    good once ``after`` requests have finished (if given)."""
    held: dict[str, str] = {}  # request id -> gate name
    announced: set[str] = set()  # gates whose hold was logged, and "<name> requests"
    finished = 0
    add_request, step = engine.add_request, engine.step

    def gated_add_request(request_id: str, prompt: Any, *args: Any, **kw: Any) -> Any:
        found = _MARKER.search(engine.tokenizer.decode(list(prompt)))
        result = add_request(request_id, prompt, *args, **kw)
        if found:
            held[request_id] = found.group(1)
        return result

    def holding() -> str | None:
        if after is not None and finished >= after:
            return f"after {after}"
        for request_id, name in list(held.items()):
            if request_id not in engine.requests:  # finished, aborted or suspended
                del held[request_id]
                continue
            if closed(name):
                return name
        return None

    def gated_step() -> Any:
        nonlocal finished
        name = holding()
        if name is None:
            outputs = step()
            finished += sum(1 for o in outputs if o.finished)
            return outputs
        if name not in announced:
            announced.add(name)
            logger.warning("engine gate %s holding", name)
        if engine.requests and f"{name} requests" not in announced:
            # From here a request stays unfinished: its shard cannot end while this holds.
            announced.add(f"{name} requests")
            logger.warning("engine gate %s holding requests in flight", name)
        aborted, engine._aborted = engine._aborted, []  # what abort_request left to report
        time.sleep(HOLD_WAIT_S)
        return aborted

    engine.add_request = gated_add_request
    engine.step = gated_step


class FileGate:
    """The test's side of a gate in a model worker (a file in ``BATCHD_TEST_GATE_DIR``)."""

    def __init__(self, directory: Path, name: str) -> None:
        self.path = Path(directory) / name
        self.marker = marker(name)

    def close(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch()

    def open(self) -> None:
        self.path.unlink(missing_ok=True)


@contextmanager
def closed_gate(directory: Path, name: str) -> Iterator[FileGate]:
    """A gate closed for the block, and open after it whatever happens (so a failed test
    never leaves the next one's engine held)."""
    gate = FileGate(directory, name)
    gate.close()
    try:
        yield gate
    finally:
        gate.open()


def _install_in_this_process() -> None:
    """``celery worker -I testkit.engine_gate``: gate every engine made from now on."""
    directory, after = os.environ.get(ENV), os.environ.get(AFTER_ENV)
    if not directory and not after:
        return
    from engine import Engine

    made = Engine.__init__

    def closed(name: str) -> bool:
        return bool(directory) and (Path(directory or ".") / name).exists()

    def __init__(self: Any, *args: Any, **kwargs: Any) -> None:
        made(self, *args, **kwargs)
        install(self, closed, after=int(after) if after else None)

    Engine.__init__ = __init__  # type: ignore[method-assign]


_install_in_this_process()
