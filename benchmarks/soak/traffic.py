"""The soak's normal tenants: what each submits, and the threads that submit and cancel it."""

from __future__ import annotations

import heapq
import json
import random
import threading
import time
from collections import Counter
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

from cli.perf.workload import request_line
from testkit.service.soak_checks import Api, BatchRecord, Tracker
from testkit.service.soak_stack import CHAT_MODEL, EMBED_MODEL, UPSTREAM_MODEL, Clock, Receiver

if TYPE_CHECKING:
    from benchmarks.soak.options import Options


WORDS = (
    "river stone lantern orbit copper meadow signal harbor velvet cipher tundra ember "
    "quartz willow falcon summit prism glacier canyon ribbon nectar beacon marble"
).split()
SCHEMA = {
    "type": "object",
    "properties": {
        "label": {"enum": ["spam", "ham"]},
        "score": {"type": "integer", "minimum": 0, "maximum": 10},
    },
    "required": ["label", "score"],
    "additionalProperties": False,
}


@dataclass
class Spec:
    kind: str
    endpoint: str
    lines: list[Any]  # dicts, or a string for a broken line
    custom_ids: list[str]
    window: str
    priority: str
    webhook: bool
    cancel_after_s: float | None


def _text(rng: random.Random, n: int) -> str:
    return " ".join(rng.choice(WORDS) for _ in range(n))


def _chat(
    rng: random.Random, cid: str, short_window: bool, model: str = CHAT_MODEL
) -> dict[str, Any]:
    body: dict[str, Any] = {
        "model": model,
        "messages": [{"role": "user", "content": _text(rng, rng.randint(3, 30))}],
        "max_tokens": rng.randint(128, 256) if short_window else rng.randint(4, 24),
    }
    if short_window or rng.random() < 0.3:
        body["ignore_eos"] = True
    if rng.random() < 0.25:
        body.update(temperature=0.8, seed=rng.randint(0, 2**31))
    else:
        body["temperature"] = 0
    return request_line(cid, body)


def _structured(rng: random.Random, cid: str) -> dict[str, Any]:
    fmt = {
        "type": "json_schema",
        "json_schema": {"name": "verdict", "strict": True, "schema": SCHEMA},
    }
    if rng.random() < 0.3:
        fmt = {"type": "json_object"}
    return request_line(
        cid,
        {
            "model": CHAT_MODEL,
            "messages": [{"role": "user", "content": f"Classify: {_text(rng, 8)}"}],
            "max_tokens": 40,
            "temperature": 0,
            "response_format": fmt,
        },
    )


def _embedding(rng: random.Random, cid: str) -> dict[str, Any]:
    inputs: Any = _text(rng, rng.randint(2, 40))
    if rng.random() < 0.3:
        inputs = [_text(rng, rng.randint(2, 12)) for _ in range(rng.randint(2, 4))]
    return request_line(cid, {"model": EMBED_MODEL, "input": inputs}, "/v1/embeddings")


def make_spec(rng: random.Random, opts: Options, tenant: str, seq: int) -> Spec:
    kinds = {"chat": 0.45, "structured": 0.2, "embeddings": 0.2, "upstream": 0.1, "broken": 0.05}
    if not opts.embeddings:
        kinds.pop("embeddings")
    if not opts.upstream:
        kinds.pop("upstream")
    kind = rng.choices(list(kinds), weights=list(kinds.values()))[0]
    if seq == 1:  # each tenant's first batch a different kind: a short run has every kind
        served = [k for k in kinds if k != "broken"]
        kind = served[(ord(tenant[-1]) - ord("a")) % len(served)]
    short = kind != "broken" and rng.random() < opts.short_window_share
    window = f"{rng.choice(opts.short_windows)}s" if short else "24h"
    n = rng.randint(16, 40) if short else rng.randint(3, opts.max_lines)
    prefix = f"{tenant}-{seq:05d}-"
    ids = [f"{prefix}{i:03d}" for i in range(n)]
    lines: list[Any]
    if kind == "embeddings":
        lines = [_embedding(rng, c) for c in ids]
        endpoint = "/v1/embeddings"
    elif kind == "upstream":  # greedy chat on the real server, short outputs: it is slower
        lines = [_chat(rng, c, False, UPSTREAM_MODEL) for c in ids]
        for line in lines:
            line["body"].update(max_tokens=rng.randint(2, 12), temperature=0)
            line["body"].pop("ignore_eos", None)
            line["body"].pop("seed", None)
        endpoint = "/v1/chat/completions"
    else:
        endpoint = "/v1/chat/completions"
        lines = [
            _structured(rng, c) if kind == "structured" and rng.random() < 0.6 else
            _chat(rng, c, short)
            for c in ids
        ]  # fmt: skip
        if kind == "broken":
            k = rng.randrange(n)
            lines[k] = '{"custom_id": "broken", not json'
            # In the file's head it fails the batch; past it, it becomes an error line with
            # no custom_id (the line cannot be read), which the line check expects as "None".
            ids = [*ids[:k], "None", *ids[k + 1 :]]
    priority = rng.choices(["low", "normal", "high"], weights=[1, 2, 1])[0]
    cancel = rng.uniform(0.2, 4.0) if rng.random() < opts.cancel_share else None
    return Spec(
        kind, endpoint, lines, ids, window, priority, rng.random() < opts.webhook_share, cancel
    )


def _jsonl(lines: list[Any]) -> bytes:
    return b"".join((x if isinstance(x, str) else json.dumps(x)).encode() + b"\n" for x in lines)


@dataclass
class TrafficStats:
    submitted: Counter = field(default_factory=Counter)  # by kind
    upload_failed: int = 0
    create_failed: Counter = field(default_factory=Counter)  # by status
    priority_refused: int = 0
    priority_granted: Counter = field(default_factory=Counter)  # "requested->granted"
    cancels: Counter = field(default_factory=Counter)  # by answer status
    lock: threading.Lock = field(default_factory=threading.Lock, repr=False)


class Traffic:
    """One submitter thread per tenant, plus the thread that sends scheduled cancels."""

    def __init__(self, opts: Options, api: Api, tracker: Tracker, receiver: Receiver,
                 clock: Clock, end_t: float):  # fmt: skip
        self.opts = opts
        self.api = api
        self.tracker = tracker
        self.receiver = receiver
        self.clock = clock
        self.end_t = end_t
        self.stats = TrafficStats()
        self.stop = threading.Event()
        self._cancels: list[tuple[float, str, str]] = []
        self._cancel_lock = threading.Condition()
        self.threads = [
            threading.Thread(target=self._submitter, args=(t,), name=f"soak-{t}", daemon=True)
            for t in api.clients
        ]
        self.canceller = threading.Thread(target=self._cancel_loop, name="soak-cancel", daemon=True)

    def start(self) -> None:
        for t in [*self.threads, self.canceller]:
            t.start()

    def join_submitters(self) -> None:
        for t in self.threads:
            t.join()

    def close(self) -> None:
        self.stop.set()
        with self._cancel_lock:
            self._cancel_lock.notify_all()
        self.canceller.join(90)

    def _submitter(self, tenant: str) -> None:
        rng = random.Random(f"{self.opts.seed}:{tenant}")
        next_t = self.clock() + rng.uniform(0, self.opts.submit_every)
        seq = 0
        while not self.stop.is_set():
            wake = min(next_t, self.end_t)
            if self.stop.wait(max(0.0, wake - self.clock())) or self.clock() >= self.end_t:
                return
            seq += 1
            try:
                self._submit(tenant, seq, make_spec(rng, self.opts, tenant, seq))
            except Exception as error:  # a harness bug: say so, keep going
                print(f"soak {tenant}: {type(error).__name__}: {error}", flush=True)
            next_t += rng.expovariate(1 / self.opts.submit_every)

    def _submit(self, tenant: str, seq: int, spec: Spec) -> None:
        data = _jsonl(spec.lines)
        up = self.api.retrying(
            tenant, "POST", "/v1/files", "POST /v1/files",
            make_kw=lambda: {"data": {"purpose": "batch"},
                             "files": {"file": (f"{tenant}-{seq}.jsonl", data)}},
        )  # fmt: skip
        if up is None or up.status_code != 200:
            with self.stats.lock:
                self.stats.upload_failed += 1
            return
        body: dict[str, Any] = {
            "input_file_id": up.json()["id"],
            "endpoint": spec.endpoint,
            "completion_window": spec.window,
            "priority": spec.priority,
            "metadata": {"soak": spec.kind},
        }
        if spec.webhook:
            body["webhook_url"] = self.receiver.url(f"/hook/{tenant}")
        key = f"soak-{tenant}-{seq}"
        created = self._create(tenant, body, key)
        if (
            created is not None
            and created.status_code in (400, 403)
            and _param(created) == "priority"
        ):
            with self.stats.lock:
                self.stats.priority_refused += 1
            body["priority"] = "normal"
            created = self._create(tenant, body, key + "-normal")
        if created is None or created.status_code != 200:
            with self.stats.lock:
                self.stats.create_failed[str(created.status_code if created else "no answer")] += 1
            return
        batch = created.json()
        granted = batch.get("priority", body["priority"])
        record = BatchRecord(
            id=batch["id"], tenant=tenant, kind=spec.kind, endpoint=spec.endpoint,
            custom_ids=spec.custom_ids, window=spec.window, priority_requested=spec.priority,
            priority=granted, webhook=spec.webhook, created_t=self.clock(),
            expires_at=batch.get("expires_at"), status=batch["status"],
            seen_wall=time.time(),
        )  # fmt: skip
        self.tracker.add(record)
        with self.stats.lock:
            self.stats.submitted[spec.kind] += 1
            self.stats.priority_granted[f"{spec.priority}->{granted}"] += 1
        if spec.cancel_after_s is not None:
            with self._cancel_lock:
                heapq.heappush(
                    self._cancels, (self.clock() + spec.cancel_after_s, record.id, tenant)
                )
                self._cancel_lock.notify_all()

    def _create(self, tenant: str, body: dict[str, Any], key: str) -> Any:
        # The same Idempotency-Key on every try: a create retried after a lost answer returns
        # the batch the first one made.
        return self.api.retrying(
            tenant, "POST", "/v1/batches", "POST /v1/batches",
            json=body, headers={"Idempotency-Key": key},
        )  # fmt: skip

    def _cancel_loop(self) -> None:
        while True:
            with self._cancel_lock:
                while not self.stop.is_set() and (
                    not self._cancels or self._cancels[0][0] > self.clock()
                ):
                    wait = self._cancels[0][0] - self.clock() if self._cancels else 1.0
                    self._cancel_lock.wait(max(0.05, min(wait, 1.0)))
                if self.stop.is_set():
                    return
                _, batch_id, tenant = heapq.heappop(self._cancels)
            r = self.api.retrying(
                tenant, "POST", f"/v1/batches/{batch_id}/cancel", "POST /v1/batches/{id}/cancel",
                for_s=60,
            )  # fmt: skip
            record = self.tracker.batches.get(batch_id)
            if record is not None:
                record.cancel_requested_t = self.clock()
            with self.stats.lock:
                self.stats.cancels[str(r.status_code if r is not None else "no answer")] += 1


def _param(r: Any) -> str | None:
    try:
        return r.json()["error"]["param"]
    except (ValueError, KeyError, TypeError):
        return None
