"""The validate task's one pass over a batch's input, creating each shard as its lines pass.

Invariants (the policy is ``docs/validation.md``): nothing is created until the head (the first
shard's lines) is clean; a shard is created only when it continues the last one, under a lock
on the batch row, so a finalize sees a fixed set and no line is planned twice;
``validation_done`` turns True only with the last shard; every request line ends as exactly one
output or error line (a bad line after the head: an error line in its shard's first chunk).
"""

from __future__ import annotations

import logging
from array import array
from collections.abc import Generator, Sequence
from contextlib import suppress
from dataclasses import dataclass, field, replace
from enum import Enum, StrEnum
from typing import Any

from sqlalchemy import select, update
from sqlalchemy.orm import Session

from core.batches.plan import PlanItem, PrefixIndex, plan_order
from core.batches.sharding import ShardPlanner, ShardSpec, cut_along_groups
from core.batchfile.reader import (
    FILE_ERRORS,
    LineValidator,
    RawLine,
    ValidationReport,
    iter_lines,
    line_error_record,
)
from core.batchfile.request import LineError
from core.database.lifecycle import BatchStatus, ShardStatus, now, transition
from core.database.results_log import ChunkRecord, batch_log_prefix, log_chunk, write_chunk
from core.database.sessions import new_session
from core.database.tables import Batch, Shard
from core.llms import specs
from core.observability import metrics
from core.settings import get_settings
from worker.events import notify
from worker.infra import past_expiry, runtime, storage
from worker.shards.checkpoints import chunk_key
from worker.shards.prepared import (
    lines_key,
    tokenizer_fingerprint,
    write_lines,
    write_order,
    write_prepared,
)
from worker.shards.release import release_for_model
from worker.shards.state import finish_if_last
from worker.validation.failures import (
    budget_error,
    enqueued_tokens,
    fail_running,
    lock_tenant_model,
    quota_error,
    validation_errors,
)
from worker.validation.token_count import TokenCounter

logger = logging.getLogger(__name__)

# With the prefix plan, the shards after the first are cut along prefix groups a window of
# this many file-order shards at a time (docs/validation.md).
WINDOW_SHARDS = 4
GROUP_BLOCKS = 4  # the prefix blocks a group's lines share beyond the window's common prefix


@dataclass(frozen=True, slots=True)
class Progress:
    """Where a validation resumes: after its last durable shard."""

    next_index: int
    line: int  # the first line after it
    offset: int  # and its byte offset


def progress(session: Session, batch_id: str) -> Progress | None:
    """The batch's validation progress, from its shard rows (None: no shard yet)."""
    last = session.execute(
        select(Shard.index, Shard.end_line, Shard.end_offset)
        .where(Shard.batch_id == batch_id)
        .order_by(Shard.index.desc())
        .limit(1)
    ).first()
    if last is None:
        return None
    index, end_line, end_offset = last
    return Progress(index + 1, end_line, end_offset)


class ValidationStop(StrEnum):
    """Why a validation run stopped without settling the batch (``in_progress`` or ``failed``)."""

    BATCH_ENDED = "batch_ended"  # the batch was cancelled or expired meanwhile
    OVERTAKEN = "overtaken"  # another run of this validation got further


# How a run ends: the batch's status it settled, or why it stopped without settling it.
RunEnd = BatchStatus | ValidationStop


class _Placement(Enum):
    """Where a planned shard stands against the shards already created."""

    NEXT = "next"  # it is the next one to create
    CREATED = "created"  # an earlier try of this run (or another run) created it already
    OVERTAKEN = "overtaken"  # the shards so far do not lead to it (another run planned them)


@dataclass(slots=True)
class _OpenShard:
    """What the open shard holds beside its range: the error lines of its bad lines, and the
    prompt tokens of each valid request (to name the line that crossed the token limit)."""

    errors: list[ChunkRecord] = field(default_factory=list)
    line_tokens: list[tuple[int, int]] = field(default_factory=list)
    prompt_tokens: int = 0
    # the prompt ids (see worker.shards.prepared), compact while a window of shards is held
    ids: list[tuple[int, Sequence[int]]] = field(default_factory=list)
    # the prefix plan (core.batches.plan): per request its line, prefix ranks, output tokens
    plan: list[tuple[int, list[int], int]] = field(default_factory=list)
    shareable_tokens: int = 0
    # a shard cut along prefix groups: its lines of the window's range, in run order
    lines: list[int] | None = None

    def add(self, line: int, prompt_tokens: int, ids: Sequence[int] | None) -> None:
        self.line_tokens.append((line, prompt_tokens))
        self.prompt_tokens += prompt_tokens
        if ids is not None:
            self.ids.append((line, ids if isinstance(ids, array) else array("I", ids)))


class _Failed(Exception):
    """The batch must fail with ``error`` (a whole-file rule broken after the head)."""

    def __init__(self, error: dict[str, Any], reason: str):
        super().__init__(error["message"])
        self.error = error
        self.reason = reason


class StreamedValidation:
    """One run of a batch's validation (see the module docstring); :meth:`run` returns the
    batch's status when it ends (``in_progress`` or ``failed``) or a :class:`ValidationStop`."""

    def __init__(
        self, batch_id: str, key: str, endpoint: str, tenant: str, resume: Progress | None
    ):
        settings = get_settings()
        self.settings = settings
        self.batch_id = batch_id
        self.key = key
        self.endpoint = endpoint
        self.tenant = tenant
        self.resume = resume
        served = [m for m, spec in settings.models.items() if specs.serves(spec, endpoint)]
        self.lines = LineValidator(
            endpoint=endpoint,
            served_models=served,
            max_requests=settings.max_requests_per_batch,
            max_line_bytes=settings.max_line_bytes,
            forwarded=specs.forwarded_models(settings.models),
            engine_models=specs.engine_models(settings.models),
        )
        self.count = TokenCounter(served)
        self.planner = ShardPlanner(
            settings.shard_max_tokens,
            settings.shard_max_requests,
            first_index=resume.next_index if resume else 0,
            after_line=resume.line - 1 if resume else 0,
            after_offset=resume.offset if resume else 0,
        )
        self.open = _OpenShard()
        self.next_index = resume.next_index if resume else 0
        self.window: list[tuple[ShardSpec, _OpenShard]] = []  # closed, not yet cut and created
        # A resumed run plans on with an empty index: the prefixes before it are not re-read.
        self.index = PrefixIndex(settings.prefix_plan_max_nodes) if settings.prefix_plan else None
        self.head = resume is None  # no shard exists yet
        self.report = ValidationReport()  # the head's errors

    # -- reading

    def _stream(self) -> Generator[RawLine]:
        sto = storage()
        max_line = self.settings.max_line_bytes
        if self.resume is None:
            with sto.reader(self.key) as stream:
                yield from iter_lines(stream, max_line_bytes=max_line)
            return
        chunks = sto.read_range(self.key, self.resume.offset, sto.size(self.key))
        yield from iter_lines(
            chunks,
            max_line_bytes=max_line,
            first_line=self.resume.line,
            base_offset=self.resume.offset,
        )

    def _replay(self) -> None:
        """Rebuild the file-wide state from the lines already in shards (after a crash):
        each parsed again, none tokenised."""
        if self.resume is None:
            return
        chunks = storage().read_range(self.key, 0, self.resume.offset)
        n = 0
        for raw in iter_lines(chunks, max_line_bytes=self.settings.max_line_bytes):
            n += 1
            with suppress(LineError):
                self.lines.check(raw)
        logger.info(
            "batch %s: validation resumes at line %s (shard %s) after re-reading %s lines",
            self.batch_id,
            self.resume.line,
            self.resume.next_index,
            n,
        )

    def run(self) -> RunEnd:
        if self.resume is not None:
            self._replay()
        lines = self._stream()
        try:
            for raw in lines:
                outcome = self._line(raw)
                if outcome is not None:
                    return outcome
            return self._end()
        except _Failed as failed:
            return self._fail_late(failed)
        finally:
            lines.close()

    def _line(self, raw: RawLine) -> RunEnd | None:
        if self.head and self.report.num_errors:
            return self._collect(raw)
        try:
            req = self.lines.check(raw)
        except LineError as err:
            if self.head and (err.code in FILE_ERRORS or not self._head_full()):
                return self._collect_error(err)
            if err.code in FILE_ERRORS:
                raise _Failed(err.to_dict(), err.code) from None
            closed = self.planner.add(raw.line, raw.offset, raw.length, 0)
            outcome = self._create(closed, last=False) if closed else None
            self.open.errors.append(ChunkRecord(raw.line, False, line_error_record(raw, err)))
            return outcome
        self.report.num_requests += 1
        tokens = self.count(req)
        closed = self.planner.add(req.line, req.offset, req.length, tokens)
        outcome = self._create(closed, last=False) if closed else None
        self.open.add(req.line, self.count.last_prompt, self.count.last_ids)
        self._plan(req.line, tokens - self.count.last_prompt)
        return outcome

    # -- the prefix plan (an optimisation: whatever goes wrong, the lines keep file order)

    def _plan(self, line: int, decode: int) -> None:
        ids = self.count.last_plan_ids
        if self.index is None or ids is None:
            return
        try:
            was_full = self.index.full
            before = self.index.shareable_tokens
            ranks = self.index.add(ids)
            self.open.shareable_tokens += self.index.shareable_tokens - before
            self.open.plan.append((line, ranks, decode))
        except Exception:
            logger.exception("batch %s: prefix plan off from line %s", self.batch_id, line)
            self.index = None
            return
        if self.index.full and not was_full:
            logger.warning(
                "batch %s: prefix index full at %s nodes (line %s): new prefixes keep file order",
                self.batch_id,
                self.index.max_nodes,
                line,
            )

    def _write_order(self, spec: ShardSpec, shard: _OpenShard) -> None:
        """Store the shard's run order when the plan changes anything (else: file order)."""
        if self.index is None or not shard.plan:
            return
        try:
            index = self.index
            order = plan_order(PlanItem(ln, index.path(r), d) for ln, r, d in shard.plan)
            if order != sorted(order):
                write_order(storage(), self.batch_id, spec.index, order)
        except Exception:
            logger.exception(
                "batch %s: shard %s keeps file order (its plan failed)", self.batch_id, spec.index
            )

    def _head_full(self) -> bool:
        """The head holds ``shard_max_requests`` lines: the next line belongs to the next shard
        (closed by the planner when that line is added)."""
        return self.planner.open_requests >= self.planner.max_requests

    def _collect(self, raw: RawLine) -> RunEnd | None:
        """The head failed: go on reading only to report the file's errors, as a whole-file
        validation does."""
        try:
            self.lines.check(raw)
        except LineError as err:
            return self._collect_error(err)
        self.report.num_requests += 1
        return None

    def _collect_error(self, err: LineError) -> RunEnd | None:
        self.report.add_error(err, self.settings.max_errors_reported)
        if err.code == "too_many_requests":
            self.report.truncated = True
            return self._fail_invalid()
        self.report.num_invalid += 1
        return None

    def _end(self) -> RunEnd:
        if self.head and self.lines.request_lines == 0:
            self.report.add_error(
                LineError(None, "empty_file", "The file holds no requests"),
                self.settings.max_errors_reported,
            )
        if self.head and self.report.num_errors:
            return self._fail_invalid()
        if self.planner.open_requests:
            outcome = self._create(self.planner.finish()[-1], last=True)
            if outcome is not None:
                return outcome
        elif self.window:
            outcome = self._create_window(last=True)
            if outcome is not None:
                return outcome
        else:
            outcome = self._mark_done()
            if outcome is not None:
                return outcome
        # Its shards may all have ended while the last ones were planned.
        finish_if_last(self.batch_id)
        return BatchStatus.IN_PROGRESS

    # -- creating shards

    def _create(self, spec: ShardSpec, *, last: bool) -> RunEnd | None:
        """Create ``spec`` with the open shard's error lines and release it, or, with the prefix
        plan after the first shard, add it to the window to cut; None to go on."""
        shard, self.open = self.open, _OpenShard()
        if self.index is not None and self.next_index > 0 and (self.window or self._groups(shard)):
            self.window.append((spec, shard))
            if len(self.window) < WINDOW_SHARDS and not last:
                return None
            return self._create_window(last)
        return self._create_all([(replace(spec, index=self.next_index), shard)], last)

    def _groups(self, shard: _OpenShard) -> bool:
        """Whether the shard's lines fall in two groups or more worth running apart: below the
        prefix all of them share, each group's lines share ``GROUP_BLOCKS`` blocks more (a
        file whose lines share only a preamble streams its shards as they close)."""
        index = self.index
        if index is None:
            return False
        try:
            paths = [p for p in (index.path(r) for _, r, _ in shard.plan) if p]
            if not paths:
                return False
            common = min(len(p) for p in paths)
            first = paths[0]
            for n in range(common):
                if any(p[n] != first[n] for p in paths):
                    common = n
                    break
            sizes: dict[int, int] = {}
            for p in paths:
                if len(p) >= common + GROUP_BLOCKS:
                    sizes[p[common]] = sizes.get(p[common], 0) + 1
            return sum(1 for n in sizes.values() if n > 1) > 1
        except Exception:
            logger.exception("batch %s: its shards keep file order", self.batch_id)
            return False

    def _create_window(self, last: bool) -> RunEnd | None:
        """Create the window's shards cut along its prefix groups, or as the file cut them
        when the plan groups nothing there (or fails)."""
        window, self.window = self.window, []
        cut = None
        try:
            cut = self._cut_window(window)
        except Exception:
            logger.exception(
                "batch %s: lines %s-%s keep their file-order shards (their cut failed)",
                self.batch_id,
                window[0][0].start_line,
                window[-1][0].end_line - 1,
            )
        if cut is None:
            cut = [
                (replace(spec, index=self.next_index + k), sh)
                for k, (spec, sh) in enumerate(window)
            ]
        return self._create_all(cut, last)

    def _cut_window(
        self, window: list[tuple[ShardSpec, _OpenShard]]
    ) -> list[tuple[ShardSpec, _OpenShard]] | None:
        """The window's lines cut into shards along their prefix groups (each drawing from the
        window's range); None when a line has no plan, no line shares a prefix or the cut
        gives the file's shards again."""
        index = self.index
        if index is None:
            return None
        items: dict[int, PlanItem] = {}
        prompts: dict[int, int] = {}
        ids: dict[int, Sequence[int]] = {}
        errors: dict[int, ChunkRecord] = {}
        shareable = 0
        for _, shard in window:
            if len(shard.plan) != len(shard.line_tokens):
                return None
            items.update((ln, PlanItem(ln, index.path(r), d)) for ln, r, d in shard.plan)
            prompts.update(shard.line_tokens)
            ids.update(shard.ids)
            errors.update((rec.line, rec) for rec in shard.errors)
            shareable += shard.shareable_tokens
        if not any(item.path for item in items.values()):
            return None
        order = plan_order(items.values())
        groups: list[tuple[int, tuple[int, ...], int]] = [
            (ln, items[ln].path, prompts[ln] + items[ln].decode) for ln in order
        ]
        groups += [(ln, (-1,), 0) for ln in sorted(errors)]  # bad lines: a group of their own
        cuts = cut_along_groups(groups, self.planner.max_tokens, self.planner.max_requests)
        as_filed = [
            sorted([*(ln for ln, _ in sh.line_tokens), *(r.line for r in sh.errors)])
            for _, sh in window
        ]
        if [sorted(lines) for lines in cuts] == as_filed:
            return None  # the same shards: each keeps its range, planned inside it
        first, end = window[0][0], window[-1][0]
        out: list[tuple[ShardSpec, _OpenShard]] = []
        for k, lines in enumerate(cuts):
            shard = _OpenShard(lines=lines, shareable_tokens=shareable if k == 0 else 0)
            for ln in sorted(lines):
                if ln in errors:
                    shard.errors.append(errors[ln])
                    continue
                shard.add(ln, prompts[ln], ids.get(ln))
            est = sum(prompts[ln] + items[ln].decode for ln in lines if ln in items)
            spec = ShardSpec(
                index=self.next_index + k,
                start_line=first.start_line,
                end_line=end.end_line,
                start_offset=first.start_offset,
                end_offset=end.end_offset,
                num_requests=len(lines),
                est_tokens=est,
            )
            out.append((spec, shard))
        return out

    def _create_all(self, created: list[tuple[ShardSpec, _OpenShard]], last: bool) -> RunEnd | None:
        """Create the shards ``created`` (one, or a window's, at once) and release them."""
        model = self.lines.model
        for spec, shard in created:
            # Before the row: a shard that exists finds its ids stored. Ids were counted with
            # the model's tokenizer: there are none without a model.
            if shard.ids and model is not None:
                tok = runtime.tokenizer(model)
                write_prepared(
                    storage(), self.batch_id, spec.index, shard.ids, tokenizer_fingerprint(tok)
                )
            if shard.lines is None:
                self._write_order(spec, shard)
        outcome = self._commit(created, last)
        if outcome is not None:
            return outcome
        if created[0][0].index == 0:
            logger.info("batch %s: in_progress with its first shard", self.batch_id)
            self.head = False
        self.next_index += len(created)
        try:
            release_for_model(self.lines.model)
        except Exception:
            logger.exception("batch %s: could not release its shards now", self.batch_id)
        return None

    def _commit(self, created: list[tuple[ShardSpec, _OpenShard]], last: bool) -> RunEnd | None:
        first, end = created[0][0], created[-1][0]
        whole = replace(
            first,
            end_line=end.end_line,
            end_offset=end.end_offset,
            num_requests=sum(spec.num_requests for spec, _ in created),
        )
        combined = _OpenShard(
            line_tokens=sorted(lt for _, sh in created for lt in sh.line_tokens),
            prompt_tokens=sum(sh.prompt_tokens for _, sh in created),
        )
        session = new_session()
        try:
            row = session.execute(
                select(
                    Batch.status, Batch.expires_at, Batch.est_prompt_tokens, Batch.max_total_tokens
                )
                .where(Batch.id == self.batch_id)
                .with_for_update()
            ).first()
            if (
                row is None
                or row.status not in (BatchStatus.VALIDATING, BatchStatus.IN_PROGRESS)
                or past_expiry(row.expires_at)
            ):
                return ValidationStop.BATCH_ENDED
            placement = self._placement(session, first)
            if placement is _Placement.OVERTAKEN:
                return ValidationStop.OVERTAKEN
            if placement is _Placement.CREATED:
                return None  # by an earlier try: go on
            tokens = int(row.est_prompt_tokens or 0) + combined.prompt_tokens
            over = self._over_quota(session, whole, combined, int(row.est_prompt_tokens or 0))
            if over is None and row.max_total_tokens is not None and tokens > row.max_total_tokens:
                over = budget_error(row.max_total_tokens, tokens, whole.end_line - 1)
            if over is not None:
                session.rollback()
                if first.index == 0:
                    return self._fail_over_quota(over, tokens, whole.num_requests)
                raise _Failed(over, "token_limit_exceeded")
            for spec, shard in created:
                # Under the batch row's lock, as the next shards: which lines a shard cut
                # along prefix groups holds (and none for any other, left by a run that failed
                # to commit its own).
                if shard.lines is not None:
                    write_lines(storage(), self.batch_id, spec.index, shard.lines)
                else:
                    storage().delete(lines_key(self.batch_id, spec.index))
                self._insert(session, spec, shard)
            values: dict[str, Any] = {
                "model": self.lines.model,
                "request_total": Batch.request_total + whole.num_requests,
                "request_failed": Batch.request_failed + sum(len(sh.errors) for _, sh in created),
                "est_prompt_tokens": tokens,
                "prefix_shareable_tokens": Batch.prefix_shareable_tokens
                + sum(sh.shareable_tokens for _, sh in created),
                "validation_done": last,
                "validated_at": now(),
            }
            if row.status == BatchStatus.VALIDATING:
                transition(
                    session,
                    self.batch_id,
                    BatchStatus.VALIDATING,
                    BatchStatus.IN_PROGRESS,
                    **values,
                )
            else:
                session.execute(
                    update(Batch)
                    .where(Batch.id == self.batch_id)
                    .values(**values)
                    .execution_options(synchronize_session=False)
                )
            session.commit()
        finally:
            session.close()
        for spec, shard in created:
            logger.info(
                "batch %s: shard %s created (lines %s-%s%s, %s requests, %s bad)%s",
                self.batch_id,
                spec.index,
                spec.start_line,
                spec.end_line - 1,
                " along prefix groups" if shard.lines is not None else "",
                spec.num_requests,
                len(shard.errors),
                "; validation done" if last and spec is end else "",
            )
        return None

    def _placement(self, session: Session, spec: ShardSpec) -> _Placement:
        """Whether ``spec`` is the next shard to create, was created already, or does not
        follow the shards so far."""
        last = progress(session, self.batch_id)
        next_index = last.next_index if last else 0
        if spec.index == next_index and (last is None or last.offset == spec.start_offset):
            return _Placement.NEXT
        same = session.execute(
            select(Shard.start_offset, Shard.end_offset).where(
                Shard.batch_id == self.batch_id, Shard.index == spec.index
            )
        ).first()
        if same is not None and tuple(same) == (spec.start_offset, spec.end_offset):
            return _Placement.CREATED
        logger.warning(
            "batch %s: shard %s does not follow its shards so far; this validation stops",
            self.batch_id,
            spec.index,
        )
        return _Placement.OVERTAKEN

    def _over_quota(
        self, session: Session, spec: ShardSpec, shard: _OpenShard, before: int
    ) -> dict[str, Any] | None:
        """The quota error if the shard takes the batch over its tenant's enqueued-token
        limit (the tenant and model stay locked until the transaction ends)."""
        model = self.lines.model or ""
        limit = self.settings.max_enqueued_tokens_per_tenant
        lock_tenant_model(session, self.tenant, model)
        used = enqueued_tokens(session, self.tenant, model, exclude=self.batch_id)
        if used + before + shard.prompt_tokens <= limit:
            return None
        if spec.index == 0:
            return quota_error(self.tenant, model, limit, used, before + shard.prompt_tokens)
        total = before
        for line, tokens in shard.line_tokens:
            total += tokens
            if used + total > limit:
                return quota_error(self.tenant, model, limit, used, total, line)
        return quota_error(self.tenant, model, limit, used, total, spec.end_line - 1)

    def _insert(self, session: Session, spec: ShardSpec, shard: _OpenShard) -> None:
        """The shard's row, and its bad lines' error lines as its first (committed) chunk."""
        bad = len(shard.errors)
        session.add(
            Shard(
                batch_id=self.batch_id,
                index=spec.index,
                status=ShardStatus.DONE if bad == spec.num_requests else ShardStatus.PENDING,
                start_line=spec.start_line,
                end_line=spec.end_line,
                start_offset=spec.start_offset,
                end_offset=spec.end_offset,
                num_requests=spec.num_requests,
                est_tokens=spec.est_tokens,
                done_requests=bad,
                num_chunks=1 if bad else 0,
            )
        )
        session.flush()
        if bad:
            key = chunk_key(self.batch_id, spec.index, 0)
            log_chunk(session, self.batch_id, key, write_chunk(storage(), key, shard.errors))

    def _mark_done(self) -> ValidationStop | None:
        """Every line is in a shard already (a run resumed at the end of the file)."""
        session = new_session()
        try:
            status = session.scalar(
                select(Batch.status).where(Batch.id == self.batch_id).with_for_update()
            )
            if status != BatchStatus.IN_PROGRESS:
                return ValidationStop.BATCH_ENDED
            session.execute(
                update(Batch)
                .where(Batch.id == self.batch_id)
                .values(validation_done=True, validated_at=now())
                .execution_options(synchronize_session=False)
            )
            session.commit()
        finally:
            session.close()
        return None

    # -- failing

    def _fail_invalid(self) -> RunEnd:
        """An error in the head: the batch fails with the file's errors (no shard exists)."""
        session = new_session()
        try:
            won = transition(
                session,
                self.batch_id,
                BatchStatus.VALIDATING,
                BatchStatus.FAILED,
                errors=validation_errors(self.report),
                request_total=self.report.num_requests + self.report.num_invalid,
            )
            session.commit()
        finally:
            session.close()
        if not won:
            return ValidationStop.BATCH_ENDED
        notify(self.batch_id, BatchStatus.FAILED)
        return BatchStatus.FAILED

    def _fail_over_quota(self, error: dict[str, Any], tokens: int, requests: int) -> RunEnd:
        """The head alone does not fit in the tenant's enqueued-token limit."""
        session = new_session()
        try:
            won = transition(
                session,
                self.batch_id,
                BatchStatus.VALIDATING,
                BatchStatus.FAILED,
                model=self.lines.model,
                est_prompt_tokens=tokens,
                errors=[error],
                request_total=requests,
            )
            session.commit()
        finally:
            session.close()
        if not won:
            return ValidationStop.BATCH_ENDED
        try:  # the head's prompt ids, stored before its shard was refused
            storage().delete_prefix(batch_log_prefix(self.batch_id))
        except Exception:
            logger.exception("batch %s: its stored prompt ids were not deleted", self.batch_id)
        metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
        logger.info("batch %s: over the enqueued-token limit: %s", self.batch_id, error["message"])
        notify(self.batch_id, BatchStatus.FAILED)
        return BatchStatus.FAILED

    def _fail_late(self, failed: _Failed) -> RunEnd:
        if not fail_running(self.batch_id, failed.error):
            return ValidationStop.BATCH_ENDED
        if failed.reason == "token_limit_exceeded":
            metrics.REJECTIONS.labels(reason="token_limit_exceeded").inc()
        logger.info("batch %s failed after its head: %s", self.batch_id, failed.error["message"])
        return BatchStatus.FAILED
