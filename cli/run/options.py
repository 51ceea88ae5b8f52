"""What a ``batchd run`` is asked to do, what it reports, and how it fails."""

from __future__ import annotations

from collections.abc import Collection
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Any

from cli.exit_codes import ExitCode
from core.batchfile.request import CHAT_URL, DEFAULT_MAX_LINE_BYTES

if TYPE_CHECKING:
    pass


class RunError(Exception):
    """A problem the user must fix (bad input, inconsistent resume state): exit 2."""


class ModelLoadError(Exception):
    """The engine could not be built: exit 1."""


@dataclass(slots=True)
class RunOptions:
    input: Path
    output: Path
    errors: Path
    model: str
    endpoint: str = CHAT_URL
    model_name: str | None = None
    engine_config: dict[str, Any] = field(default_factory=dict)
    checkpoint_every: int = 256
    checkpoint_interval_s: float = 30.0
    window: int | None = None  # default: 4 x max_num_seqs
    strict: bool = False
    max_line_bytes: int = DEFAULT_MAX_LINE_BYTES

    @property
    def served_models(self) -> Collection[str] | None:
        return None if self.model_name is None else (self.model_name,)

    def fingerprint(self) -> dict[str, Any]:
        """What must not change between a run and its resumption."""
        st = self.input.stat()
        return {
            "input": str(self.input.resolve()),
            "input_size": st.st_size,
            "input_mtime_ns": st.st_mtime_ns,
            "errors": str(self.errors.resolve()),
            "endpoint": self.endpoint,
            "model": str(Path(self.model).resolve()) if Path(self.model).exists() else self.model,
            "model_name": self.model_name,
        }


@dataclass(slots=True)
class RunSummary:
    output: str
    errors: str
    total: int
    succeeded: int
    failed: int
    invalid_lines: int
    resumed_requests: int
    computed_requests: int
    prompt_tokens: int
    completion_tokens: int
    elapsed_s: float
    completion_tokens_per_s: float

    @property
    def exit_code(self) -> ExitCode:
        return ExitCode.COMPLETED_WITH_FAILURES if self.failed else ExitCode.OK
