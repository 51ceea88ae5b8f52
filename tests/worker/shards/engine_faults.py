"""Engine faults for tests of the shard runner's retry paths (test-only: nothing in the service
refers to this module)."""

from __future__ import annotations

from typing import Any


def install_test_fault(engine: Any, spec: str) -> None:
    """Make ``engine`` fail on prompts containing a marker: ``step:<text>`` (every engine step
    fails while a request whose prompt contains <text> is in the engine) or ``request:<text>``
    (the engine refuses such a request with a ``RequestError``)."""
    from engine import RequestError

    kind, _, marker = spec.partition(":")
    if kind not in ("step", "request") or not marker:
        raise ValueError(f"a fault is step:<text> or request:<text>, not {spec!r}")
    tok = engine.tokenizer
    poisoned: set[str] = set()
    add_request, abort_request, step = engine.add_request, engine.abort_request, engine.step

    def faulty_add_request(request_id: str, prompt: Any, *args: Any, **kw: Any) -> Any:
        if marker in tok.decode(list(prompt)):
            if kind == "request":
                raise RequestError(f"injected test fault: the prompt contains {marker!r}")
            poisoned.add(request_id)
        return add_request(request_id, prompt, *args, **kw)

    def faulty_abort_request(request_id: str) -> Any:
        poisoned.discard(request_id)
        return abort_request(request_id)

    def faulty_step() -> Any:
        if poisoned:
            raise RuntimeError(f"injected test fault: a prompt in this step contains {marker!r}")
        return step()

    engine.add_request = faulty_add_request
    engine.abort_request = faulty_abort_request
    engine.step = faulty_step
