"""The hostile tenant itself: its options, its counts, and the threads that abuse the service."""

from __future__ import annotations

import functools
import json
import statistics
import threading
import time
from collections import Counter
from collections.abc import Callable
from dataclasses import asdict, dataclass, field
from typing import Any

import httpx

from benchmarks.soak_hostile.bodies import (
    BODY_PLANS,
    MIB,
    BodyAttempt,
    SlowUpload,
    send_large_body,
    slow_upload,
)
from benchmarks.soak_hostile.files import CHAT, _good, amplifying_file, estimate_file, nested_file
from benchmarks.soak_hostile.phases import Phase, Phases
from benchmarks.soak_hostile.trickle import TrickleReceiver
from benchmarks.soak_hostile.uploads import UPLOAD_EXPECT, UploadAnswer, _error_code
from benchmarks.soak_hostile.watch import HostileTracker
from testkit.service.soak_checks import Api, BatchRecord

HOSTILE = "hostile"


@dataclass
class HostileOptions:
    every_s: float = 10.0  # between two of its batches (nested, amplifying, small in turn)
    nested_depth: int = 2000
    amplify_mib: float = 2.0
    slow_uploads: int = 4
    trickle_every_s: float = 3.0
    estimates: int = 16
    estimate_every_s: float = 20.0
    estimate_lines: int = 10_000
    give_up_after_s: float = 0.5  # the estimate clients that disconnect early
    body_senders: int = 4  # concurrent large-body senders (BODY_PLANS in turn)
    body_mib: int = 256  # each large body, made as it is sent
    body_every_s: float = 1.0  # between one sender's requests
    body_timeout_s: float = 30.0  # a large body unanswered this long: given up (a failure)
    answer_within_s: float = 2.0  # a refusal's most seconds after it was due
    api_rss_bound_mib: float = 256.0  # the API's peak over its RSS before the senders began
    upload_every_s: float = 5.0  # between two rounds of the upload abuser
    upload_parts: int = 50  # max_upload_parts of the soak's service: the parts bound abused
    upload_busy_s: float = 40.0  # how long a step is sent again while it gets 429


@dataclass
class HostileStats:
    batches: Counter = field(default_factory=Counter)  # by kind
    upload_failed: Counter = field(default_factory=Counter)  # by kind
    create_answers: Counter = field(default_factory=Counter)  # "kind status"
    cancel_answers: Counter = field(default_factory=Counter)
    estimate_answers: Counter = field(default_factory=Counter)  # "patient 200", "hasty gave up"
    estimate_latency_s: list[float] = field(default_factory=list)  # patient clients' answers
    floods: int = 0
    slow_uploads: list[SlowUpload] = field(default_factory=list)
    bodies: list[BodyAttempt] = field(default_factory=list)
    upload_answers: list[UploadAnswer] = field(default_factory=list)
    errors: list[str] = field(default_factory=list)
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class HostileTenant:
    """The threads of the hostile tenant (see the module docstring); each acts only while
    ``phases`` says the hostile tenant is active, and all stop at ``end_t``."""

    def __init__(self, opts: HostileOptions, api: Api, key: str, port: int,
                 tracker: HostileTracker, trickle: TrickleReceiver, phases: Phases,
                 clock: Callable[[], float], end_t: float, head: int,
                 body_limit: int = MIB):  # fmt: skip
        self.opts = opts
        self.api = api
        self.key = key
        self.port = port
        self.tracker = tracker
        self.trickle = trickle
        self.phases = phases
        self.clock = clock
        self.end_t = end_t
        self.head = head
        self.body_limit = body_limit  # max_request_body_bytes: the JSON routes' limit
        self.stats = HostileStats()
        self.stop = threading.Event()
        self._estimate_file: str | None = None
        self._upload_id: str | None = None  # the upload abuser's current upload
        self.threads = [
            threading.Thread(target=self._guard(self._batches), name="soak-hostile", daemon=True),
            threading.Thread(target=self._guard(self._floods), name="soak-flood", daemon=True),
            threading.Thread(target=self._guard(self._slow), name="soak-slow", daemon=True),
            threading.Thread(target=self._guard(self._uploads), name="soak-parts", daemon=True),
            *(
                threading.Thread(target=self._guard(functools.partial(self._bodies, i)),
                                 name=f"soak-body-{i}", daemon=True)
                for i in range(self.opts.body_senders)
            ),
        ]  # fmt: skip

    def start(self) -> None:
        for t in self.threads:
            t.start()

    def join(self, timeout: float = 120.0) -> None:
        deadline = time.monotonic() + timeout
        for t in self.threads:
            t.join(max(0.1, deadline - time.monotonic()))

    def close(self) -> None:
        self.stop.set()
        self.join(30)

    def _guard(self, body: Callable[[], None]) -> Callable[[], None]:
        def run() -> None:
            try:
                body()
            except Exception as error:  # a harness bug: say so
                print(f"soak hostile: {type(error).__name__}: {error}", flush=True)
                with self.stats.lock:
                    self.stats.errors.append(f"{type(error).__name__}: {error}")

        return run

    def _wait_active(self) -> bool:
        """Sleep until the tenant is active (True) or the traffic is over (False)."""
        while not self.stop.is_set() and self.clock() < self.end_t:
            if self.phases.hostile_at(self.clock()):
                return True
            self.stop.wait(0.5)
        return False

    def _sleep(self, seconds: float) -> None:
        self.stop.wait(max(0.0, min(seconds, self.end_t - self.clock())))

    # -- batches: nested, amplifying, small; all with the trickled webhook -------------------

    def _batches(self) -> None:
        kinds = ("nested", "amplify", "small")
        seq = 0
        while self._wait_active():
            seq += 1
            kind = kinds[(seq - 1) % len(kinds)]
            began = self.clock()
            if kind == "nested":
                data, n = nested_file(seq, self.opts.nested_depth, self.head)
            elif kind == "amplify":
                data, n = amplifying_file(seq, self.opts.amplify_mib, self.head)
            else:
                data = "".join(json.dumps(_good(f"w{seq}-{i}")) + "\n" for i in range(3)).encode()
                n = 3
            self._submit(kind, seq, data, n, cancel=kind != "small")
            self._sleep(self.opts.every_s - (self.clock() - began))

    def _submit(self, kind: str, seq: int, data: bytes, lines: int, cancel: bool) -> None:
        up = self.api.retrying(
            HOSTILE, "POST", "/v1/files", "POST /v1/files", for_s=30,
            make_kw=lambda: {"data": {"purpose": "batch"},
                             "files": {"file": (f"hostile-{kind}-{seq}.jsonl", data)}},
        )  # fmt: skip
        if up is None or up.status_code != 200:
            with self.stats.lock:
                self.stats.upload_failed[kind] += 1
            return
        body: dict[str, Any] = {
            "input_file_id": up.json()["id"],
            "endpoint": CHAT,
            "completion_window": "24h",
            "metadata": {"soak": f"hostile-{kind}"},
        }
        body["webhook_url"] = self.trickle.url()  # its events come while it is active
        created = self.api.retrying(
            HOSTILE, "POST", "/v1/batches", "POST /v1/batches", for_s=30, json=body,
            headers={"Idempotency-Key": f"soak-hostile-{seq}"},
        )  # fmt: skip
        with self.stats.lock:
            self.stats.create_answers[
                f"{kind} {created.status_code if created is not None else 'no answer'}"
            ] += 1
        if created is None or created.status_code != 200:
            return
        batch = created.json()
        record = BatchRecord(
            id=batch["id"], tenant=HOSTILE, kind=kind, endpoint=CHAT, custom_ids=[],
            window="24h", priority_requested="normal", priority=batch.get("priority", "normal"),
            webhook=True, created_t=self.clock(), expires_at=None,
            status=batch["status"], seen_wall=time.time(),
        )  # fmt: skip
        self.tracker.add_batch(record, lines)
        with self.stats.lock:
            self.stats.batches[kind] += 1
        if cancel:
            r = self.api.retrying(
                HOSTILE, "POST", f"/v1/batches/{record.id}/cancel",
                "POST /v1/batches/{id}/cancel", for_s=60,
            )  # fmt: skip
            record.cancel_requested_t = self.clock()
            with self.stats.lock:
                self.stats.cancel_answers[str(r.status_code if r is not None else "no answer")] += 1

    # -- estimate floods ----------------------------------------------------------------------

    def _floods(self) -> None:
        while self._wait_active():
            began = self.clock()
            if self._estimate_file is None:
                data = estimate_file(self.opts.estimate_lines)
                up = self.api.retrying(
                    HOSTILE, "POST", "/v1/files", "POST /v1/files", for_s=30,
                    make_kw=lambda data=data: {
                        "data": {"purpose": "batch"},
                        "files": {"file": ("hostile-estimate.jsonl", data)}},
                )  # fmt: skip
                if up is None or up.status_code != 200:
                    with self.stats.lock:
                        self.stats.upload_failed["estimate"] += 1
                    self._sleep(self.opts.estimate_every_s)
                    continue
                self._estimate_file = up.json()["id"]
            body = {
                "input_file_id": self._estimate_file,
                "endpoint": CHAT,
                "completion_window": "24h",
            }
            clients = [
                threading.Thread(target=self._estimate, args=(body, i % 2 == 0), daemon=True)
                for i in range(self.opts.estimates)
            ]
            for c in clients:
                c.start()
            for c in clients:
                c.join(120)
            with self.stats.lock:
                self.stats.floods += 1
            self._sleep(self.opts.estimate_every_s - (self.clock() - began))

    def _estimate(self, body: dict[str, Any], hasty: bool) -> None:
        who = "hasty" if hasty else "patient"
        timeout = self.opts.give_up_after_s if hasty else 90.0
        began = self.clock()
        r = self.api.call(
            HOSTILE, "POST", "/v1/batches/estimate", "POST /v1/batches/estimate",
            json=body, timeout=timeout,
        )  # fmt: skip
        with self.stats.lock:
            if r is None:
                self.stats.estimate_answers[f"{who} gave up" if hasty else f"{who} no answer"] += 1
            else:
                self.stats.estimate_answers[f"{who} {r.status_code}"] += 1
                if not hasty and r.status_code == 200:
                    self.stats.estimate_latency_s.append(self.clock() - began)

    # -- slow uploads -------------------------------------------------------------------------

    def _slow(self) -> None:
        while self._wait_active():
            phase = self.phases.at(self.clock())
            assert phase is not None
            opened = []
            for _ in range(self.opts.slow_uploads):
                record = SlowUpload(phase.index, round(self.clock(), 1))
                with self.stats.lock:
                    self.stats.slow_uploads.append(record)
                t = threading.Thread(
                    target=slow_upload,
                    args=(self.port, self.key, lambda p=phase: self._phase_over(p),
                          self.opts.trickle_every_s, record, self.clock),
                    daemon=True,
                )  # fmt: skip
                t.start()
                opened.append(t)
            for t in opened:
                t.join(phase.end - phase.start + 60)
            # Not again in this phase (if the server cut them all short): wait for the next.
            while not self.stop.is_set() and self.clock() < min(phase.end, self.end_t):
                self.stop.wait(0.5)

    def slow_open(self) -> int:
        with self.stats.lock:
            return sum(1 for u in self.stats.slow_uploads if not u.ended)

    def _phase_over(self, phase: Phase) -> bool:
        return self.stop.is_set() or self.clock() >= min(phase.end, self.end_t)

    # -- large bodies -------------------------------------------------------------------------

    def _bodies(self, index: int) -> None:
        seq = index
        while self._wait_active():
            plan = BODY_PLANS[seq % len(BODY_PLANS)]
            seq += 1
            began = self.clock()
            limit = self.body_limit if plan.keyed and plan.framing == "chunked" else 0
            record = BodyAttempt(plan.name, plan.keyed, round(began, 2), limit)
            with self.stats.lock:
                self.stats.bodies.append(record)
            send_large_body(self.port, plan, self.key, self.opts.body_mib * MIB, record,
                            self.clock, self.opts.body_timeout_s)  # fmt: skip
            self._sleep(self.opts.body_every_s - (self.clock() - began))

    def bodies_open(self) -> int:
        with self.stats.lock:
            return sum(1 for b in self.stats.bodies if not b.ended)

    # -- uploads past their bounds ------------------------------------------------------------

    def _uploads(self) -> None:
        bounded_in = -1  # the phase whose parts bound was last abused (once a phase)
        while self._wait_active():
            began = self.clock()
            phase = self.phases.at(began)
            for round_ in (self._upload_past_bytes, self._upload_of_one_byte):
                self._upload_round(round_)
            if phase is not None and phase.index != bounded_in:
                bounded_in = phase.index
                self._upload_round(self._upload_past_parts)
            self._sleep(self.opts.upload_every_s - (self.clock() - began))

    def _upload_round(self, round_: Callable[[], None]) -> None:
        """One round; one whose step got no answer, a 5xx or a surprise stops there, and its
        upload is cancelled (unjudged: it may have completed)."""
        self._upload_id = None
        try:
            round_()
        except _Stop:
            if self._upload_id is not None:
                self.api.call(HOSTILE, "POST", f"/v1/uploads/{self._upload_id}/cancel",
                              "POST /v1/uploads/{id}/cancel")  # fmt: skip

    def _step(self, kind: str, method: str, path: str, route: str, **kw: Any) -> httpx.Response:
        """One step, sent again after a 429 (the tenant's upload slots are its slow uploads'
        until the server cuts them) for up to ``upload_busy_s``."""
        deadline = self.clock() + self.opts.upload_busy_s
        while True:
            began = self.clock()
            r = self.api.call(HOSTILE, method, path, route, **kw)
            status = None if r is None else r.status_code
            with self.stats.lock:
                self.stats.upload_answers.append(
                    UploadAnswer(round(began, 2), round(self.clock(), 2), kind, status,
                                 _error_code(r))
                )  # fmt: skip
            if status != 429 or self.clock() >= deadline or self.stop.is_set():
                break
            self.stop.wait(1.0)
        if r is None or status != UPLOAD_EXPECT[kind]:
            raise _Stop
        return r

    def _create_upload(self, size: int) -> str:
        body = {"filename": "hostile.jsonl", "purpose": "batch", "bytes": size,
                "mime_type": "application/jsonl"}  # fmt: skip
        r = self._step("create", "POST", "/v1/uploads", "POST /v1/uploads", json=body)
        self._upload_id = str(r.json()["id"])
        return self._upload_id

    def _part(self, kind: str, upload: str, size: int) -> str | None:
        data = ("part", b"a" * size, "application/octet-stream")
        r = self._step(kind, "POST", f"/v1/uploads/{upload}/parts",
                       "POST /v1/uploads/{id}/parts", files={"data": data})  # fmt: skip
        return str(r.json()["id"]) if r.status_code == 200 else None

    def _complete(self, kind: str, upload: str, parts: list[str]) -> None:
        self._step(kind, "POST", f"/v1/uploads/{upload}/complete",
                   "POST /v1/uploads/{id}/complete", json={"part_ids": parts})  # fmt: skip

    def _cancel(self, kind: str, upload: str) -> None:
        self._step(kind, "POST", f"/v1/uploads/{upload}/cancel", "POST /v1/uploads/{id}/cancel")

    def _upload_past_bytes(self) -> None:
        """1,024 bytes declared: parts past them refused, the rest completed; then a part
        and a cancel after the complete, both refused."""
        upload = self._create_upload(1024)
        first = self._part("part within bytes", upload, 1000)
        self._part("part past bytes", upload, 100)
        second = self._part("part within bytes", upload, 24)
        self._part("part past bytes", upload, 1)
        assert first is not None and second is not None
        self._complete("complete", upload, [first, second])
        self._part("part after complete", upload, 1)
        self._cancel("cancel after complete", upload)

    def _upload_of_one_byte(self) -> None:
        """1 byte declared: a 64 KiB part refused as it streams, one byte taken, the next
        refused; cancelled, then a part and a complete refused."""
        upload = self._create_upload(1)
        self._part("part past bytes", upload, 64 * 1024)
        part = self._part("part within bytes", upload, 1)
        self._part("part past bytes", upload, 1)
        self._cancel("cancel", upload)
        self._part("part after cancel", upload, 1)
        assert part is not None
        self._complete("complete after cancel", upload, [part])

    def _upload_past_parts(self) -> None:
        """As many one-byte parts as the service's parts bound, then one more (refused)."""
        upload = self._create_upload(self.opts.upload_parts + 8)
        for _ in range(self.opts.upload_parts):
            if self.stop.is_set():
                raise _Stop
            self._part("part within bytes", upload, 1)
        self._part("part past the parts bound", upload, 1)
        self._cancel("cancel", upload)
        self._upload_id = None

    # -- the report ---------------------------------------------------------------------------

    def report(self) -> dict[str, Any]:
        with self.stats.lock:
            s = self.stats
            latency = sorted(s.estimate_latency_s)
            return {
                "batches": dict(s.batches),
                "upload_failed": dict(s.upload_failed),
                "create_answers": dict(s.create_answers),
                "cancel_answers": dict(s.cancel_answers),
                "estimate_floods": s.floods,
                "estimate_answers": dict(s.estimate_answers),
                "estimate_latency_s": (
                    {"p50": round(statistics.median(latency), 2), "max": round(latency[-1], 2)}
                    if latency
                    else None
                ),  # fmt: skip
                "slow_uploads": [asdict(u) for u in s.slow_uploads],
                "errors": list(s.errors),
            }


class _Stop(Exception):
    """An upload round stops: a step got no answer, a 5xx, or not what it must."""
