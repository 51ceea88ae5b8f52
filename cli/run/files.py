"""``batchd run``'s output: the partial files, the checkpoint record, resuming."""

from __future__ import annotations

import json
import os
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import TYPE_CHECKING, Any

from core.storage.local import fsync_dir

if TYPE_CHECKING:
    pass
from cli.run.options import RunError

PROGRESS_VERSION = 1


@dataclass(slots=True)
class Progress:
    """The checkpoint record (``OUT.progress.json``)."""

    fingerprint: dict[str, Any]
    next_line: int = 1
    input_offset: int = 0
    out_bytes: int = 0
    err_bytes: int = 0
    requests_done: int = 0
    succeeded: int = 0
    failed: int = 0
    prompt_tokens: int = 0
    completion_tokens: int = 0
    finished: bool = False
    version: int = PROGRESS_VERSION

    @classmethod
    def load(cls, path: Path) -> Progress | None:
        try:
            data = json.loads(path.read_text())
        except FileNotFoundError:
            return None
        except ValueError as exc:
            raise RunError(f"cannot read the progress file {path}: {exc}") from None
        if data.get("version") != PROGRESS_VERSION:
            raise RunError(f"the progress file {path} has an unknown version; use --restart")
        return cls(**data)


class ResultFiles:
    """OUT.partial and ERR.partial, written in input order, checkpointed with the progress
    file; :meth:`finish` renames them into place."""

    def __init__(self, output: Path, errors: Path) -> None:
        self.output, self.errors = output, errors
        self.out_partial = output.with_name(output.name + ".partial")
        self.err_partial = errors.with_name(errors.name + ".partial")
        self.progress_path = output.with_name(output.name + ".progress.json")
        self._out: Any = None
        self._err: Any = None

    def open(self, progress: Progress, *, resume: bool) -> None:
        for path in (self.out_partial, self.err_partial):
            path.parent.mkdir(parents=True, exist_ok=True)
        if resume:
            for path, size in (
                (self.out_partial, progress.out_bytes),
                (self.err_partial, progress.err_bytes),
            ):
                actual = path.stat().st_size if path.exists() else -1
                if actual < size:
                    raise RunError(
                        f"{path} holds {max(actual, 0)} bytes but the last checkpoint recorded "
                        f"{size}; the partial results are damaged, use --restart"
                    )
        self._out = open(self.out_partial, "r+b" if resume else "wb")  # noqa: SIM115
        self._err = open(self.err_partial, "r+b" if resume else "wb")  # noqa: SIM115
        if resume:  # drop whatever was written after the last checkpoint
            for fh, size in ((self._out, progress.out_bytes), (self._err, progress.err_bytes)):
                fh.truncate(size)
                fh.seek(size)

    def write(self, data: bytes, *, ok: bool) -> None:
        (self._out if ok else self._err).write(data)

    def checkpoint(self, progress: Progress) -> None:
        for fh in (self._out, self._err):
            fh.flush()
            os.fsync(fh.fileno())
        progress.out_bytes = self._out.tell()
        progress.err_bytes = self._err.tell()
        self.save_progress(progress)

    def save_progress(self, progress: Progress) -> None:
        tmp = self.progress_path.with_name(self.progress_path.name + ".tmp")
        with open(tmp, "w") as fh:
            json.dump(asdict(progress), fh)
            fh.flush()
            os.fsync(fh.fileno())
        os.replace(tmp, self.progress_path)
        fsync_dir(self.progress_path.parent)

    def close(self) -> None:
        for fh in (self._out, self._err):
            if fh is not None:
                fh.close()
        self._out = self._err = None

    def finish(self, progress: Progress) -> None:
        """Mark the run finished (so a crash from here on only has to redo the renames),
        then move the results into place."""
        if self._out is not None:
            self.checkpoint(progress)
            self.close()
        progress.finished = True
        self.save_progress(progress)
        self.complete_renames()

    def complete_renames(self) -> None:
        for partial, final in ((self.err_partial, self.errors), (self.out_partial, self.output)):
            if partial.exists():
                os.replace(partial, final)
        fsync_dir(self.output.parent)
        if self.errors.parent != self.output.parent:
            fsync_dir(self.errors.parent)
        self.progress_path.unlink(missing_ok=True)
