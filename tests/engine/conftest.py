"""The device the engine tests run on: ``BATCHD_TEST_DEVICE`` (default ``cpu``), in float32
whatever the device, so greedy output can be compared with ``generate()`` on the CPU.

An engine built with an explicit ``device`` or ``dtype`` keeps it; every other engine a test
builds (through ``Engine``, ``LLM``, ``EngineHost`` or the benchmark) gets these."""

from __future__ import annotations

import os
from collections.abc import Iterator
from typing import Any

import pytest

from engine.core.config import EngineConfig

TEST_DEVICE = os.environ.get("BATCHD_TEST_DEVICE", "cpu")


@pytest.fixture(autouse=True, scope="module")
def engine_test_device() -> Iterator[str]:
    """Module-scoped, so the module-scoped engines of a test module are built under it too."""
    build = EngineConfig.from_kwargs.__func__  # type: ignore[attr-defined]

    def from_kwargs(cls: type[EngineConfig], **kwargs: Any) -> EngineConfig:
        kwargs.setdefault("device", TEST_DEVICE)
        kwargs.setdefault("dtype", "float32")
        return build(cls, **kwargs)

    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(EngineConfig, "from_kwargs", classmethod(from_kwargs))
        yield TEST_DEVICE


@pytest.fixture(scope="module")
def path() -> str:
    """The tiny demo Llama (built on first use), shared by a module's tests."""
    from core.llms.demo import build

    return str(build("llama-tiny"))


@pytest.fixture(scope="module")
def llm(path: str) -> Any:
    """An ``LLM`` over :func:`path`, shared by a module's tests."""
    from engine import LLM

    return LLM(path)
