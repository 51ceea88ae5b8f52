"""``batchd run``: an OpenAI batch file through the engine in this process, no servers.

The same line validation as the service (:mod:`core.batchfile`) and the same output and error
lines (:mod:`core.results`), in input order. Memory stays bounded whatever the file's size:

* the input is read lazily, one line at a time (:func:`core.batchfile.iter_lines`);
* at most ``window`` requests are in flight (tokenised, in the engine, or finished but waiting
  for an earlier line) — a bounded reorder buffer in front of the output files;
* the only per-line state is the validation scan's two 8-byte arrays (custom_id hashes and
  line numbers) used to find duplicate custom_ids before anything runs.

Resuming: results go to ``OUT.partial`` and ``ERR.partial`` in input order. Every checkpoint
(``--checkpoint-every`` requests, or ``--checkpoint-interval`` seconds) flushes and fsyncs both,
then atomically replaces ``OUT.progress.json`` with the next input line, its byte offset and the
byte sizes of both partial files. A run that finds a progress file for the same input and
options truncates the partial files to the recorded sizes, seeks the input to the recorded
offset and carries on: even after SIGKILL nothing before the last checkpoint is recomputed and
every request ends up exactly once in OUT or ERR. At the end the partial files are renamed into
place and the progress file is removed.
"""

from __future__ import annotations

import hashlib
import json
import os
import signal
import sys
import time
from array import array
from collections import deque
from collections.abc import Collection, Iterator
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING, Annotated, Any

import typer

from cli.exit_codes import ExitCode, exit_codes_help
from core.batchfile import (
    CHAT_URL,
    DEFAULT_MAX_LINE_BYTES,
    GENERATION_URLS,
    BatchRequest,
    LineError,
    RawLine,
    iter_lines,
    parse_request,
)
from core.generation import (
    check_prompt,
    error_for_exception,
    error_record,
    generation_result,
    prompt_token_ids,
    sampling_kwargs,
)
from core.results import dumps_line, output_line, response_body
from core.storage_local import fsync_dir

if TYPE_CHECKING:
    from engine import Engine, SamplingParams

PROGRESS_VERSION = 1


def sampling_params(req: BatchRequest, prompt_len: int, context: int) -> SamplingParams:
    """The same translation as the service's (``core.generation``), as engine parameters."""
    from engine import SamplingParams

    return SamplingParams(**sampling_kwargs(req, prompt_len, context))


# ============================================================================================
# Input: a validation scan, then lazy reading from any line.
# ============================================================================================


def _custom_id_hash(custom_id: str) -> int:
    digest = hashlib.blake2b(custom_id.encode("utf-8", "surrogatepass"), digest_size=8).digest()
    return int.from_bytes(digest, "little", signed=True)


def _custom_id_of(raw: RawLine) -> str | None:
    """The line's custom_id when it has a usable one, for error lines of invalid requests."""
    try:
        obj = json.loads(raw.data)
    except ValueError:
        return None
    custom_id = obj.get("custom_id") if isinstance(obj, dict) else None
    return custom_id if isinstance(custom_id, str) and custom_id else None


def line_error_record(raw: RawLine, err: LineError) -> dict[str, Any]:
    """An input line that does not validate: an error line naming the line number."""
    message = err.message if err.message.startswith("Line ") else f"Line {raw.line}: {err.message}"
    return error_record(_custom_id_of(raw), err.code, message, param=err.param)


@dataclass(slots=True)
class ScanReport:
    """What the validation scan found; ``duplicates`` maps each custom_id used more than once
    to the line of its first use (usually empty)."""

    num_lines: int = 0
    num_requests: int = 0
    num_invalid: int = 0
    first_errors: list[LineError] = field(default_factory=list)
    duplicates: dict[str, int] = field(default_factory=dict)

    @property
    def num_valid(self) -> int:
        return self.num_requests - self.num_invalid


def _parse(raw: RawLine, options: RunOptions) -> BatchRequest:
    return parse_request(
        raw,
        endpoint=options.endpoint,
        served_models=options.served_models,
        max_line_bytes=options.max_line_bytes,
    )


def scan_input(options: RunOptions, keep_errors: int = 10) -> ScanReport:
    """Validate every line once, in bounded memory (16 bytes per valid request).

    Duplicate custom_ids are found by sorting 64-bit hashes; the few lines whose hash repeats
    are then read again to compare the ids themselves, so a hash collision is never reported.
    """
    import numpy as np

    report = ScanReport()
    hashes, lines = array("q"), array("q")
    with open(options.input, "rb") as fh:
        for raw in iter_lines(fh, max_line_bytes=options.max_line_bytes):
            report.num_lines = raw.line
            report.num_requests += 1
            try:
                req = _parse(raw, options)
            except LineError as err:
                report.num_invalid += 1
                if len(report.first_errors) < keep_errors:
                    report.first_errors.append(err)
                continue
            hashes.append(_custom_id_hash(req.custom_id))
            lines.append(raw.line)
    if len(hashes) < 2:
        return report
    h = np.frombuffer(hashes, dtype=np.int64)
    order = np.argsort(h, kind="stable")
    sorted_h = h[order]
    repeated = sorted_h[1:] == sorted_h[:-1]
    if not repeated.any():
        return report
    suspect_lines = set(np.frombuffer(lines, dtype=np.int64)[order][1:][repeated].tolist())
    suspect_hashes = set(sorted_h[1:][repeated].tolist())
    del h, order, sorted_h, repeated, hashes, lines
    first_line: dict[str, int] = {}
    with open(options.input, "rb") as fh:
        for raw in iter_lines(fh, max_line_bytes=options.max_line_bytes):
            try:
                req = _parse(raw, options)
            except LineError:
                continue
            if _custom_id_hash(req.custom_id) not in suspect_hashes:
                continue
            first = first_line.setdefault(req.custom_id, raw.line)
            if first != raw.line:
                report.duplicates[req.custom_id] = first
                report.num_invalid += 1
                if len(report.first_errors) < keep_errors:
                    report.first_errors.append(_duplicate_error(raw.line, req.custom_id, first))
    del suspect_lines
    return report


def _duplicate_error(line: int, custom_id: str, first: int) -> LineError:
    return LineError(
        line,
        "duplicate_custom_id",
        f"custom_id {json.dumps(custom_id)[:60]} on line {line} was already used on line "
        f"{first}; custom_id must be unique within a batch",
        "custom_id",
    )


# ============================================================================================
# Output: partial files, checkpoints, resume.
# ============================================================================================


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


class RunError(Exception):
    """A problem the user must fix (bad input, inconsistent resume state): exit 2."""


class ModelLoadError(Exception):
    """The engine could not be built: exit 1."""


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


# ============================================================================================
# The run
# ============================================================================================


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


@dataclass(slots=True, eq=False)
class _Slot:
    """One input request between reading and writing; ``record`` set means ready."""

    line: int
    end_offset: int
    req: BatchRequest | None = None
    request_id: str | None = None
    record: dict[str, Any] | None = None
    ok: bool = False
    output: Any = None


class _Interrupted(Exception):
    pass


class _StopFlag:
    """SIGINT/SIGTERM ask the run to stop at the next safe point (between two lines, so the
    checkpoint it writes is consistent); a second signal stops it at once, and the previous
    checkpoint still holds."""

    def __init__(self) -> None:
        self.requested: str | None = None

    def __call__(self, signum: int, _frame: Any) -> None:
        if self.requested is not None:
            raise KeyboardInterrupt
        self.requested = signal.Signals(signum).name


class BatchRunner:
    """Feed the engine from the input with a bounded window; write results in input order."""

    def __init__(
        self, options: RunOptions, engine: Engine, report: ScanReport, stop: _StopFlag
    ) -> None:
        self.options = options
        self.stop = stop
        self.engine = engine
        self.tok = engine.tokenizer
        self.context = int(engine.max_model_len)
        self.report = report
        max_num_seqs = int(engine.config.max_num_seqs)
        self.window = options.window or max(4 * max_num_seqs, 64)
        self.slots: deque[_Slot] = deque()
        self.by_request: dict[str, _Slot] = {}
        self._first_seen: dict[str, int] = {}  # custom_ids known to repeat -> first line

    def _lines(self, progress: Progress) -> Iterator[RawLine]:
        with open(self.options.input, "rb") as fh:
            fh.seek(progress.input_offset)
            yield from iter_lines(
                fh,
                max_line_bytes=self.options.max_line_bytes,
                first_line=progress.next_line,
                base_offset=progress.input_offset,
            )

    def _admit(self, raw: RawLine) -> _Slot:
        slot = _Slot(raw.line, raw.offset + raw.length)
        try:
            req = _parse(raw, self.options)
        except LineError as err:
            slot.record = line_error_record(raw, err)
            return slot
        first = self.report.duplicates.get(req.custom_id)
        if first is not None and first != raw.line:
            err = _duplicate_error(raw.line, req.custom_id, first)
            slot.record = error_record(req.custom_id, err.code, err.message, param=err.param)
            return slot
        slot.req = req
        try:
            ids = prompt_token_ids(self.tok, req)
            check_prompt(req, len(ids), self.context)
            params = sampling_params(req, len(ids), self.context)
            slot.request_id = f"line-{raw.line}"
            self.engine.add_request(slot.request_id, ids, params)
        except Exception as exc:
            slot.record = error_for_exception(req, exc)
            return slot
        self.by_request[slot.request_id] = slot
        return slot

    def _record_for(self, slot: _Slot) -> None:
        output, req = slot.output, slot.req
        assert req is not None
        if output.error:
            slot.record = error_record(req.custom_id, "invalid_request", output.error)
        elif any(c.finish_reason == "abort" for c in output.outputs):
            slot.record = error_record(
                req.custom_id, "server_error", "The request was aborted by the engine",
                status_code=500, type="server_error",
            )  # fmt: skip
        else:
            result = generation_result(self.tok, req, output)
            body = response_body(req, result, model=self.options.model_name)
            slot.record = output_line(req.custom_id, body)
            slot.ok = True
            slot.output = result  # keep only the token counts

    def run(self, files: ResultFiles, progress: Progress, bar: Any) -> int:
        """Returns the number of requests computed by this run."""
        options = self.options
        lines = self._lines(progress)
        exhausted = False
        computed = 0
        since_checkpoint = 0
        last_checkpoint = time.monotonic()
        while True:
            while not exhausted and len(self.slots) < self.window:
                raw = next(lines, None)
                if raw is None:
                    exhausted = True
                    break
                self.slots.append(self._admit(raw))
            # Write every finished request at the head, in input order.
            while self.slots and (
                self.slots[0].record is not None or self.slots[0].output is not None
            ):
                slot = self.slots.popleft()
                if slot.record is None:
                    self._record_for(slot)
                assert slot.record is not None
                files.write(dumps_line(slot.record), ok=slot.ok)
                progress.requests_done += 1
                progress.next_line = slot.line + 1
                progress.input_offset = slot.end_offset
                if slot.ok:
                    progress.succeeded += 1
                    progress.prompt_tokens += slot.output.prompt_tokens
                    progress.completion_tokens += slot.output.completion_tokens
                    bar.tokens(slot.output.completion_tokens)
                else:
                    progress.failed += 1
                computed += 1
                since_checkpoint += 1
                bar.advance()
                now = time.monotonic()
                if (
                    since_checkpoint >= options.checkpoint_every
                    or now - last_checkpoint >= options.checkpoint_interval_s
                ):
                    files.checkpoint(progress)
                    since_checkpoint, last_checkpoint = 0, now
            if not self.slots:
                if exhausted:
                    return computed
                continue  # the whole window was written: read more input
            if self.stop.requested:
                raise _Interrupted(self.stop.requested)
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(
                    f"the engine holds no request but line {self.slots[0].line} has no result"
                )
            for output in self.engine.step():
                slot = self.by_request.pop(output.request_id, None)
                if slot is not None:
                    slot.output = output


# ============================================================================================
# Progress display
# ============================================================================================


class _Bar:
    """A rich progress bar (requests, completion tokens/s, ETA) on a terminal; silent
    otherwise."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from rich.console import Console
        from rich.progress import (
            BarColumn,
            MofNCompleteColumn,
            Progress,
            TextColumn,
            TimeElapsedColumn,
            TimeRemainingColumn,
        )

        self._progress = Progress(
            TextColumn("requests"),
            BarColumn(),
            MofNCompleteColumn(),
            TextColumn("{task.fields[tok_s]:>8.1f} tok/s"),
            TimeElapsedColumn(),
            TextColumn("ETA"),
            TimeRemainingColumn(),
            console=Console(stderr=True),
            disable=not enabled,
        )
        self._task = self._progress.add_task("run", total=total, completed=done, tok_s=0.0)
        self._tokens = 0
        self._start = time.monotonic()
        self._last_refresh = 0.0

    def __enter__(self) -> _Bar:
        self._progress.start()
        return self

    def __exit__(self, *exc: object) -> None:
        self._progress.stop()

    def tokens(self, n: int) -> None:
        self._tokens += n

    def advance(self) -> None:
        now = time.monotonic()
        self._progress.advance(self._task)
        if now - self._last_refresh > 0.5:
            self._last_refresh = now
            elapsed = max(now - self._start, 1e-9)
            self._progress.update(self._task, tok_s=self._tokens / elapsed)


# ============================================================================================
# Entry point
# ============================================================================================


def _say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def run_batch_file(
    options: RunOptions, *, restart: bool = False, show_progress: bool = False
) -> RunSummary:
    """Run ``options.input`` to completion (or resume it); raises :class:`RunError` for input
    the user must fix and :class:`_Interrupted` on SIGINT/SIGTERM after a checkpoint."""
    start = time.monotonic()
    if options.endpoint not in GENERATION_URLS:
        raise RunError(
            f"--endpoint must be one of {', '.join(GENERATION_URLS)}, got {options.endpoint}"
        )
    files = ResultFiles(options.output, options.errors)
    fingerprint = options.fingerprint()
    progress = None if restart else Progress.load(files.progress_path)
    if progress is not None and progress.fingerprint != fingerprint:
        changed = sorted(k for k in fingerprint if progress.fingerprint.get(k) != fingerprint[k])
        raise RunError(
            f"{files.progress_path} belongs to a run with a different {', '.join(changed)}; "
            "re-run with the same input and options to resume it, or pass --restart"
        )
    if progress is not None and progress.finished:
        files.complete_renames()
        _say("the previous run had finished; its results are in place")
        return _summary(
            options,
            progress,
            resumed=progress.requests_done,
            computed=0,
            total=progress.requests_done,
            invalid=0,
            start=start,
        )

    _say(f"validating {options.input} …")
    report = scan_input(options)
    for err in report.first_errors:
        where = "" if err.line is None or err.message.startswith("Line ") else f"line {err.line}: "
        _say(f"  {where}{err.message} ({err.code})")
    if report.num_invalid > len(report.first_errors):
        _say(f"  … {report.num_invalid - len(report.first_errors)} more invalid lines")
    if report.num_requests == 0:
        raise RunError(f"{options.input} holds no requests")
    if report.num_valid == 0:
        raise RunError(f"no line of {options.input} is a valid request; nothing to run")
    if options.strict and report.num_invalid:
        raise RunError(f"{report.num_invalid} invalid lines and --strict: nothing was run")
    if report.num_invalid:
        _say(
            f"{report.num_invalid} invalid lines go to the error file; running the other {report.num_valid}"
        )

    from engine import Engine

    _say(f"loading {options.model} …")
    try:
        engine = Engine(options.model, **options.engine_config)
    except Exception as exc:  # a missing or unreadable model dir, a bad engine option
        raise ModelLoadError(f"cannot load the model {options.model}: {exc}") from exc

    resumed = 0
    if progress is None:
        progress = Progress(fingerprint=fingerprint)
        files.open(progress, resume=False)
        files.checkpoint(progress)
    else:
        resumed = progress.requests_done
        files.open(progress, resume=True)
        _say(
            f"resuming at line {progress.next_line}: {resumed} of {report.num_requests} "
            "requests were already done"
        )

    stop = _StopFlag()
    previous = {sig: signal.signal(sig, stop) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        runner = BatchRunner(options, engine, report, stop)
        with _Bar(report.num_requests, resumed, show_progress) as bar:
            try:
                computed = runner.run(files, progress, bar)
            except _Interrupted:
                files.checkpoint(progress)
                files.close()
                _say(
                    f"interrupted: {progress.requests_done} of {report.num_requests} requests are "
                    "checkpointed; run the same command again to continue"
                )
                raise
        files.finish(progress)
    finally:
        files.close()
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    return _summary(
        options,
        progress,
        resumed=resumed,
        computed=computed,
        total=report.num_requests,
        invalid=report.num_invalid,
        start=start,
    )


def _summary(
    options: RunOptions,
    progress: Progress,
    *,
    resumed: int,
    computed: int,
    total: int,
    invalid: int,
    start: float,
) -> RunSummary:
    elapsed = time.monotonic() - start
    return RunSummary(
        output=str(options.output),
        errors=str(options.errors),
        total=total,
        succeeded=progress.succeeded,
        failed=progress.failed,
        invalid_lines=invalid,
        resumed_requests=resumed,
        computed_requests=computed,
        prompt_tokens=progress.prompt_tokens,
        completion_tokens=progress.completion_tokens,
        elapsed_s=round(elapsed, 3),
        completion_tokens_per_s=round(progress.completion_tokens / elapsed, 1) if elapsed else 0.0,
    )


def _memory_size(value: str | None) -> int | float | None:
    """``--kv-cache-memory``: a fraction (0.5), bytes (1073741824) or a size (2GiB, 512MB)."""
    if value is None:
        return None
    text = value.strip().lower().removesuffix("b")
    units = {"k": 1 << 10, "m": 1 << 20, "g": 1 << 30, "t": 1 << 40, "ki": 1 << 10,
             "mi": 1 << 20, "gi": 1 << 30, "ti": 1 << 40}  # fmt: skip
    for suffix in sorted(units, key=len, reverse=True):
        if text.endswith(suffix):
            return int(float(text[: -len(suffix)]) * units[suffix])
    if "." in text:
        return float(text)
    return int(text)


RUN_HELP = (
    "Run an OpenAI batch FILE through a local model in this process, no servers."
    "\n\n"
    "Output and error lines have the service's formats, in input order. Input lines that do "
    "not validate (bad JSON, a missing field, a duplicate custom_id, ...) become error-file "
    "lines whose message names the line number, and the run carries on. Only a file with no "
    "valid request at all (say, every url differs from --endpoint), or any invalid line with "
    "--strict, stops the run before the model loads (exit 2). Requests the model cannot run "
    "(a prompt longer than its context) also go to the error file."
    "\n\n"
    "Interrupted (Ctrl-C, SIGTERM, even SIGKILL), the same command resumes from the last "
    "checkpoint: OUT.partial, ERR.partial and OUT.progress.json hold the state until the run "
    "ends. Memory stays bounded whatever the file's size."
)


def run(
    file: Annotated[
        Path, typer.Argument(exists=True, dir_okay=False, readable=True, help="JSONL batch file.")
    ],
    output: Annotated[Path, typer.Option("-o", "--output", help="Output JSONL file.")],
    model: Annotated[str, typer.Option("--model", help="Local Hugging Face model directory.")],
    errors: Annotated[
        Path | None,
        typer.Option("--errors", help="Error JSONL file (default: OUT with .errors.jsonl)."),
    ] = None,
    endpoint: Annotated[str, typer.Option(help="Endpoint every request targets.")] = CHAT_URL,
    model_name: Annotated[
        str | None,
        typer.Option(
            help="Model name written in responses; requests naming another model are errors "
            "(default: each request's own body.model, any accepted)."
        ),
    ] = None,
    max_num_seqs: Annotated[
        int | None, typer.Option(min=1, help="Engine: sequences per step.")
    ] = None,
    max_num_batched_tokens: Annotated[
        int | None, typer.Option(min=1, help="Engine: token budget per step.")
    ] = None,
    num_kv_blocks: Annotated[int | None, typer.Option(min=1, help="Engine: KV blocks.")] = None,
    kv_cache_memory: Annotated[
        str | None, typer.Option(help="Engine: KV cache size, a fraction (0.5) or bytes (2GiB).")
    ] = None,
    dtype: Annotated[
        str | None, typer.Option(help="Engine: auto, float32, float16, bfloat16.")
    ] = None,
    device: Annotated[str | None, typer.Option(help="Engine: auto, cpu, cuda, cuda:N.")] = None,
    engine_options: Annotated[
        str | None,
        typer.Option(
            help="Any engine options as JSON, like BATCHD_ENGINE_OPTIONS "
            '(\'{"admission": "fcfs", "max_model_len": 2048}\'); the flags above win.'
        ),
    ] = None,
    checkpoint_every: Annotated[
        int, typer.Option(min=1, help="Checkpoint after this many requests.")
    ] = 256,
    checkpoint_interval: Annotated[
        float, typer.Option(min=0.0, help="…or after this many seconds.")
    ] = 30.0,
    window: Annotated[
        int | None,
        typer.Option(min=1, help="Requests in flight at most (default: 4 x max-num-seqs)."),
    ] = None,
    strict: Annotated[bool, typer.Option(help="Refuse to run if any line is invalid.")] = False,
    restart: Annotated[
        bool, typer.Option(help="Discard the checkpoint of an earlier run and start over.")
    ] = False,
    as_json: Annotated[
        bool, typer.Option("--json", help="Print a JSON summary on stdout.")
    ] = False,
) -> None:
    if errors is None:
        stem = output.name.removesuffix(".jsonl")
        errors = output.with_name(f"{stem}.errors.jsonl")
    try:
        kv = _memory_size(kv_cache_memory)
    except ValueError:
        raise typer.BadParameter(
            f"expected a fraction or a size, got {kv_cache_memory!r}",
            param_hint="--kv-cache-memory",
        ) from None
    try:
        extra = json.loads(engine_options) if engine_options else {}
    except ValueError as exc:
        raise typer.BadParameter(f"not JSON: {exc}", param_hint="--engine-options") from None
    if not isinstance(extra, dict):
        raise typer.BadParameter("expected a JSON object", param_hint="--engine-options")
    engine_config = extra | {
        k: v
        for k, v in {
            "max_num_seqs": max_num_seqs,
            "max_num_batched_tokens": max_num_batched_tokens,
            "num_kv_blocks": num_kv_blocks,
            "kv_cache_memory": kv,
            "dtype": dtype,
            "device": device,
        }.items()
        if v is not None
    }
    options = RunOptions(
        input=file,
        output=output,
        errors=errors,
        model=model,
        endpoint=endpoint,
        model_name=model_name,
        engine_config=engine_config,
        checkpoint_every=checkpoint_every,
        checkpoint_interval_s=checkpoint_interval,
        window=window,
        strict=strict,
    )
    try:
        summary = run_batch_file(options, restart=restart, show_progress=sys.stderr.isatty())
    except RunError as exc:
        _say(f"error: {exc}")
        raise typer.Exit(int(ExitCode.USAGE)) from None
    except (_Interrupted, KeyboardInterrupt):
        raise typer.Exit(int(ExitCode.INTERRUPTED)) from None
    except (ModelLoadError, OSError) as exc:  # no model, disk full, unreadable file
        _say(f"error: {exc}")
        raise typer.Exit(int(ExitCode.ERROR)) from None
    _say(
        f"done: {summary.succeeded} succeeded, {summary.failed} failed of {summary.total} "
        f"({summary.resumed_requests} resumed, {summary.computed_requests} computed now) in "
        f"{summary.elapsed_s:.1f}s, {summary.completion_tokens_per_s} completion tok/s; "
        f"{summary.output}, {summary.errors}"
    )
    if as_json:
        sys.stdout.write(json.dumps(asdict(summary)) + "\n")
    raise typer.Exit(int(summary.exit_code))


def register(app: typer.Typer) -> None:
    app.command(name="run", help=RUN_HELP, epilog=exit_codes_help())(run)
