"""The run: feed the engine from the input through a bounded window, write results in input
order, checkpoint."""

from __future__ import annotations

import signal
import sys
import time
from collections import deque
from collections.abc import Iterator
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any

from cli.run.files import Progress, ResultFiles
from cli.run.options import ModelLoadError, RunError, RunOptions, RunSummary
from cli.run.scan import ScanReport, duplicate_error, line_error_record, parse_line, scan_input
from core.batchfile.reader import RawLine, iter_lines
from core.batchfile.request import GENERATION_URLS, BatchRequest, LineError
from core.batchfile.results import dumps_line
from core.llms.generation import (
    aborted_record,
    error_for_exception,
    error_record,
    finished_record,
    is_aborted,
    prepare_request,
)

if TYPE_CHECKING:
    from engine import Engine

# ============================================================================================


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


class Interrupted(Exception):
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
        self.vocab_size = len(self.tok)
        self.report = report
        max_num_seqs = engine.config.resolved_max_num_seqs
        self.window = options.window or max(4 * max_num_seqs, 64)
        self.slots: deque[_Slot] = deque()
        self.by_request: dict[str, _Slot] = {}

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
        from engine import SamplingParams

        slot = _Slot(raw.line, raw.offset + raw.length)
        try:
            req = parse_line(raw, self.options)
        except LineError as err:
            slot.record = line_error_record(raw, err)
            return slot
        first = self.report.duplicates.get(req.custom_id)
        if first is not None and first != raw.line:
            dup = duplicate_error(raw.line, req.custom_id, first)
            slot.record = error_record(req.custom_id, dup.code, dup.message, param=dup.param)
            return slot
        slot.req = req
        try:
            # SamplingParams may refuse a value: an error line too
            ids, params = prepare_request(
                self.tok, req, self.context, self.vocab_size, make_params=SamplingParams
            )
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
        if is_aborted(output):
            slot.record = aborted_record(req)
            return
        slot.record, result = finished_record(self.tok, req, output, model=self.options.model_name)
        slot.ok = result is not None
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
                raise Interrupted(self.stop.requested)
            if not self.engine.has_unfinished_requests():
                raise RuntimeError(
                    f"the engine holds no request but line {self.slots[0].line} has no result"
                )
            for output in self.engine.step():
                waiting = self.by_request.pop(output.request_id, None)
                if waiting is not None:
                    waiting.output = output


class _Bar:
    """A rich progress bar (requests, completion tokens/s, ETA) on a terminal; silent
    otherwise."""

    def __init__(self, total: int, done: int, enabled: bool) -> None:
        from rich.console import Console

        from cli.progress import requests_progress

        self._progress = requests_progress(
            "requests",
            "{task.fields[tok_s]:>8.1f} tok/s",
            console=Console(stderr=True),
            enabled=enabled,
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


def say(message: str) -> None:
    sys.stderr.write(message + "\n")
    sys.stderr.flush()


def run_batch_file(
    options: RunOptions, *, restart: bool = False, show_progress: bool = False
) -> RunSummary:
    """Run ``options.input`` to completion (or resume it); raises :class:`RunError` for input
    the user must fix and :class:`Interrupted` on SIGINT/SIGTERM after a checkpoint."""
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
        say("the previous run had finished; its results are in place")
        return _summary(
            options,
            progress,
            resumed=progress.requests_done,
            computed=0,
            total=progress.requests_done,
            invalid=0,
            start=start,
        )

    say(f"validating {options.input} …")
    report = scan_input(options)
    for err in report.first_errors:
        where = "" if err.line is None or err.message.startswith("Line ") else f"line {err.line}: "
        say(f"  {where}{err.message} ({err.code})")
    if report.num_invalid > len(report.first_errors):
        say(f"  … {report.num_invalid - len(report.first_errors)} more invalid lines")
    if report.num_requests == 0:
        raise RunError(f"{options.input} holds no requests")
    if report.num_valid == 0:
        raise RunError(f"no line of {options.input} is a valid request; nothing to run")
    if options.strict and report.num_invalid:
        raise RunError(f"{report.num_invalid} invalid lines and --strict: nothing was run")
    if report.num_invalid:
        say(
            f"{report.num_invalid} invalid lines go to the error file; running the other {report.num_valid}"
        )

    from cli.models import local_model_dir
    from engine import Engine

    say(f"loading {options.model} …")
    try:
        engine = Engine(local_model_dir(options.model, say=say), **options.engine_config)
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
        say(
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
            except Interrupted:
                files.checkpoint(progress)
                files.close()
                say(
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
